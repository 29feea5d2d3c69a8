"""Attention over a paged KV cache in plain PyTorch (any device), and the step's metadata.

New keys/values are scattered into their slots; then each prefill chunk attends over its
gathered blocks with a causal mask offset by what was cached, and all one-token queries
(decodes) attend in one padded batched call. Backends that read the blocks in place
(csrc/paged_attention.cpp on the CPU; a GPU kernel later) replace the decode half.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import AttentionParams, attend, causal_mask, sdpa
from .kv_cache import PagedKVCache


@dataclass
class PrefillSlice:
    q_start: int  # first row of this sequence's queries in the flat batch
    q_len: int
    ctx_len: int  # keys it attends over: cached + new
    table: torch.Tensor  # block ids
    masks: dict = field(default_factory=dict)  # window -> causal mask, built once per step, not per layer

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = causal_mask(self.ctx_len - self.q_len, self.q_len, window, self.table.device)
        return self.masks[window]


@dataclass
class PagedMetadata:
    """Where this step's tokens go in the pool and which keys each query sees."""

    slot_mapping: torch.Tensor  # [N] slot of each new token: block * block_size + offset
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor | None  # [B] rows of the flat batch that are one-token queries
    decode_tables: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_ctx: torch.Tensor | None  # [B, 1] keys each decode row sees (its position + 1)
    decode_max_ctx: int = 0  # the largest decode_ctx
    _decode_masks: dict = field(default_factory=dict)  # window -> [B, 1, 1, S], built once per step

    def decode_mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self._decode_masks:
            S = self.decode_tables.shape[1] * block_size
            key_pos = torch.arange(S, device=self.decode_ctx.device)
            mask = key_pos < self.decode_ctx
            if window is not None:
                mask &= key_pos > self.decode_ctx - 1 - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]


@dataclass
class TorchPagedAttention:
    params: list[AttentionParams]  # per layer
    cache: PagedKVCache
    every_row_reads_the_cache = False  # prefill chunks attend in slices (SDPA); only decodes go row by row

    def forward(self, layer, q, k, v, meta: PagedMetadata):
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [blocks, block_size, Hkv, D]
        nb, bs, H, D = kc.shape
        # k and v as stored (a bf16 cache under fp32 activations rounds them), then read back
        # at the queries' dtype: every query attends over the stored values
        k, v = k.to(kc.dtype), v.to(vc.dtype)
        kc.view(nb * bs, H, D).index_copy_(0, meta.slot_mapping, k)
        vc.view(nb * bs, H, D).index_copy_(0, meta.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        p = self.params[layer]
        for s in meta.prefills:
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.ctx_len == s.q_len:  # nothing cached before this chunk: its own k/v are all the keys
                keys, vals = k[rows], v[rows]
            else:  # index_select copies whole blocks; it is several times faster than fancy indexing
                keys = kc.index_select(0, s.table).view(-1, H, D)[:s.ctx_len]
                vals = vc.index_select(0, s.table).view(-1, H, D)[:s.ctx_len]
            keys, vals = keys.to(q.dtype), vals.to(q.dtype)
            if s.ctx_len == s.q_len and (p.window is None or p.window >= s.q_len):
                out[rows] = sdpa(q[rows], keys, vals, None, p, causal=True)
            else:
                out[rows] = sdpa(q[rows], keys, vals, s.mask(p.window), p)
        if meta.decode_rows is not None:
            self.decode(layer, q, out, kc, vc, meta)
        return out

    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               meta: PagedMetadata) -> None:
        """The one-token rows: their blocks gathered into one padded batch."""
        B = meta.decode_rows.shape[0]
        _, bs, H, D = kc.shape
        flat = meta.decode_tables.view(-1)
        keys = kc.index_select(0, flat).view(B, -1, H, D).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        vals = vc.index_select(0, flat).view(B, -1, H, D).transpose(1, 2).to(q.dtype)
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, D]
        p = self.params[layer]
        out[meta.decode_rows] = attend(qd, keys, vals, meta.decode_mask(p.window, bs), p).squeeze(2)
