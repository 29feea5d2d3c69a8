"""Attention backends behind one interface (base.AttentionBackend), chosen by name and device.

    backend_class(name, device, kv_dtype)   "auto": the first registered one that runs there
        "cpu"    CpuPagedAttention    CPU with the compiled kernel; the compiled decoder stack
                                      may run its steps (fused_stack)
        "torch"  TorchPagedAttention  any device, plain PyTorch
    CausalAttention(params)           no cache (the uncached reference loop)

Each step the runner describes its batch once (AttentionBatch: query start locations,
sequence lengths, block tables, slots, positions, logits rows); the backend's `prepare`
turns it into metadata of its own, which every layer's `forward` receives. So a backend,
a GPU kernel wanting cu_seqlens and its own page-table layout included, is one class and
one registration:

    class FlashAttention(AttentionBackend):   # supports(), prepare(), forward()
        ...
    register_backend("flash", FlashAttention)

tests/test_attention_backends.py adds one from outside the package this way. Registered
here, above "torch", a backend also becomes "auto"'s choice where it runs.
"""
from __future__ import annotations

from .base import AttentionBackend, AttentionBatch, AttentionParams, attend, causal_mask, index_tensor, layer_params, sdpa
from .causal import CausalAttention
from .cpu import CpuPagedAttention
from .kv_cache import PagedKVCache
from .paged import PagedMetadata, PrefillSlice, TorchPagedAttention
from .registry import backend_class, register_backend

__all__ = ["AttentionBackend", "AttentionBatch", "AttentionParams", "CausalAttention", "CpuPagedAttention",
           "PagedKVCache", "PagedMetadata", "PrefillSlice", "TorchPagedAttention", "attend", "backend_class",
           "causal_mask", "index_tensor", "layer_params", "register_backend", "sdpa"]

# "auto"'s preference order: the first whose supports() passes runs
register_backend("cpu", CpuPagedAttention)
register_backend("torch", TorchPagedAttention)  # runs anywhere: last
