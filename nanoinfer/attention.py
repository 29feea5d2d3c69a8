"""Attention backends: where the KV cache lives and how a layer attends over it.

A model layer computes q, k, v for a flat run of T new tokens and hands them to
`backend.attend(layer, q, k, v)`; the backend stores k and v where its cache keeps
them and returns the attention output. Swapping the backend swaps the cache layout
(none, one contiguous buffer, paged blocks) without touching model code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from . import cpu_kernels

if TYPE_CHECKING:
    from .kv_cache import PagedKVCache


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""
        ...


def causal_mask(start: int, T: int, window: int | None) -> torch.Tensor:
    """[T, start + T] boolean mask: query i (absolute position start + i) sees key j
    when j <= start + i and, with a sliding window w, j > start + i - w."""
    q_pos = torch.arange(start, start + T).unsqueeze(1)
    k_pos = torch.arange(start + T).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """q: [T, H, D], k/v: [S, Hkv, D] -> [T, H, D]; grouped-query heads are shared, not copied.
    Inputs go in as 4-D [1, heads, len, D]: PyTorch's CPU flash kernel takes only 4-D and
    falls back to the much slower math path for 3-D."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


@dataclass
class CausalAttention:
    """No cache: every forward sees only its own tokens. The reference (uncached) loop uses it."""

    windows: list[int | None]  # per layer

    def attend(self, layer, q, k, v):
        T, window = q.shape[0], self.windows[layer]
        if window is None or window >= T:
            return sdpa(q, k, v, None, causal=True)
        return sdpa(q, k, v, causal_mask(0, T, window))


@dataclass
class PrefillSlice:
    q_start: int  # first row of this sequence's queries in the flat batch
    q_len: int
    ctx_len: int  # keys it attends over: cached + new
    table: torch.Tensor  # block ids
    masks: dict = field(default_factory=dict)  # window -> causal mask, built once per step, not per layer

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = causal_mask(self.ctx_len - self.q_len, self.q_len, window)
        return self.masks[window]


@dataclass
class PagedAttention:
    """Attention over a paged KV cache, in plain PyTorch (the CPU path).

    New keys/values are scattered into their slots; then each prefill chunk attends over
    its gathered blocks with a causal mask offset by what was cached, and all one-token
    queries (decodes) attend in one padded batched call, or, on the CPU, in the compiled
    kernel that reads the blocks in place (decode_kernel). A fused GPU kernel can take
    the same place without the model noticing.
    """

    cache: "PagedKVCache"
    slot_mapping: torch.Tensor  # [N] slot of each new token: block * block_size + offset
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor | None  # [B] rows of the flat batch that are one-token queries
    decode_tables: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_ctx: torch.Tensor | None  # [B, 1] keys each decode row sees (its position + 1)
    windows: list[int | None]  # per layer
    decode_max_ctx: int = 0  # the largest decode_ctx
    decode_kernel: bool = False  # decodes run the compiled CPU kernel (cpu_kernels.py), reading blocks in place
    _decode_masks: dict = field(default_factory=dict)  # window -> [B, 1, 1, S], built once per step

    def decode_mask(self, window: int | None) -> torch.Tensor:
        if window not in self._decode_masks:
            S = self.decode_tables.shape[1] * self.cache.block_size
            key_pos = torch.arange(S, device=self.decode_ctx.device)
            mask = key_pos < self.decode_ctx
            if window is not None:
                mask &= key_pos > self.decode_ctx - 1 - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]

    def attend(self, layer, q, k, v):
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [blocks, block_size, Hkv, D]
        nb, bs, H, D = kc.shape
        kc.view(nb * bs, H, D).index_copy_(0, self.slot_mapping, k)
        vc.view(nb * bs, H, D).index_copy_(0, self.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        window = self.windows[layer]
        for p in self.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.ctx_len == p.q_len:  # nothing cached before this chunk: its own k/v are all the keys
                keys, vals = k[rows], v[rows]
            else:  # index_select copies whole blocks; it is several times faster than fancy indexing
                keys = kc.index_select(0, p.table).view(-1, H, D)[:p.ctx_len]
                vals = vc.index_select(0, p.table).view(-1, H, D)[:p.ctx_len]
            if p.ctx_len == p.q_len and (window is None or window >= p.q_len):
                out[rows] = sdpa(q[rows], keys, vals, None, causal=True)
            else:
                out[rows] = sdpa(q[rows], keys, vals, p.mask(window))
        if self.decode_rows is not None and self.decode_kernel:
            cpu_kernels.paged_decode(q, out, self.decode_rows, kc, vc, self.decode_tables, self.decode_ctx,
                                       self.decode_max_ctx, window)
        elif self.decode_rows is not None:
            B = self.decode_rows.shape[0]
            flat = self.decode_tables.view(-1)
            keys = kc.index_select(0, flat).view(B, -1, H, D).transpose(1, 2)  # [B, Hkv, S, D]
            vals = vc.index_select(0, flat).view(B, -1, H, D).transpose(1, 2)
            qd = q[self.decode_rows].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=self.decode_mask(window),
                                               enable_gqa=qd.shape[1] != H)
            out[self.decode_rows] = o.squeeze(2)
        return out
