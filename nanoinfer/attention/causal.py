"""No cache: every forward sees only its own tokens. The reference (uncached) loop uses it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kv_cache
from .base import AttentionParams, causal_mask, sdpa


@dataclass
class CausalAttention:
    params: list[AttentionParams]  # per layer
    kv_dtype: torch.dtype | None = None  # round k and v to this format first, as a cache of it stores them

    def forward(self, layer, q, k, v, metadata=None):
        if self.kv_dtype is not None:  # stored and read back (a q8_0 cache's rotation undone)
            rot_k, rot_v = kv_cache.rotations(self.kv_dtype, q.shape[-1])
            k = kv_cache.rotate(kv_cache.read(kv_cache.store(k, self.kv_dtype, rot_k), q.dtype), rot_k)
            v = kv_cache.rotate(kv_cache.read(kv_cache.store(v, self.kv_dtype, rot_v), q.dtype), rot_v)
        T, p = q.shape[0], self.params[layer]
        if p.window is None or p.window >= T:
            return sdpa(q, k, v, None, p, causal=True)
        return sdpa(q, k, v, causal_mask(0, T, p.window, q.device), p)
