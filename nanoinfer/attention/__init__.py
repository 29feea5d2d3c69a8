"""Attention backends behind one interface, and the factory that picks one for a KV cache.

    get_backend(params, cache)  ->  CpuPagedAttention (CPU, compiled decode kernel available)
                                    TorchPagedAttention (any device, plain PyTorch)
    CausalAttention(params)     ->  no cache (the uncached reference loop)

A GPU kernel would be one more class with the same `forward` and a line here; today the
runner builds one PagedMetadata for every backend and the compiled decoder stack reads the
CPU backend directly, so a backend needing metadata of its own (cu_seqlens, its page layout)
needs those two changed too (issue 27).
"""
from __future__ import annotations

from .base import AttentionBackend, AttentionParams, attend, causal_mask, layer_params, sdpa
from .causal import CausalAttention
from .cpu import CpuPagedAttention
from .kv_cache import PagedKVCache
from .paged import PagedMetadata, PrefillSlice, TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionParams", "CausalAttention", "CpuPagedAttention", "PagedKVCache",
           "PagedMetadata", "PrefillSlice", "TorchPagedAttention", "attend", "causal_mask", "get_backend",
           "layer_params", "sdpa"]


def get_backend(params: list[AttentionParams], cache: PagedKVCache) -> TorchPagedAttention:
    if CpuPagedAttention.supported(cache.k):
        return CpuPagedAttention(params, cache)
    return TorchPagedAttention(params, cache)
