"""No cache: every forward sees only its own tokens. The reference (uncached) loop uses it."""
from __future__ import annotations

from dataclasses import dataclass

from .base import AttentionParams, causal_mask, sdpa


@dataclass
class CausalAttention:
    params: list[AttentionParams]  # per layer

    def forward(self, layer, q, k, v, metadata=None):
        T, p = q.shape[0], self.params[layer]
        if p.window is None or p.window >= T:
            return sdpa(q, k, v, None, p, causal=True)
        return sdpa(q, k, v, causal_mask(0, T, p.window), p)
