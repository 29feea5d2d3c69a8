"""Attention over a paged KV cache in plain PyTorch (any device), and its step metadata.

New keys/values are scattered into their slots; then each prefill chunk attends over its
gathered blocks with a causal mask offset by what was cached, and all one-token queries
(decodes) attend in one padded batched call. The CPU backend (cpu.py) reads the blocks in
place with csrc/paged_attention.cpp instead and shares this metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kv_cache
from .base import AttentionBackend, AttentionBatch, attend, causal_mask, index_tensor, sdpa


@dataclass
class PrefillSlice:
    q_start: int  # first row of this sequence's queries in the flat batch
    q_len: int
    ctx_len: int  # keys it attends over: cached + new
    tables: list[torch.Tensor]  # its block ids in each KV group's pool
    masks: dict = field(default_factory=dict)  # window -> causal mask, built once per step, not per layer

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            self.masks[window] = causal_mask(self.ctx_len - self.q_len, self.q_len, window, self.tables[0].device)
        return self.masks[window]


@dataclass
class PagedMetadata:
    """Where this step's tokens go in the pool and which keys each query sees."""

    slot_mapping: list[torch.Tensor]  # per KV group, [N]: slot of each new token, block * block_size + offset
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor | None  # [B] rows of the flat batch that are one-token queries
    decode_tables: list[torch.Tensor] | None  # per KV group, [B, max_blocks], padded with block 0
    decode_ctx: torch.Tensor | None  # [B, 1] keys each decode row sees (its position + 1)
    decode_max_ctx: int = 0  # the largest decode_ctx
    _decode_masks: dict = field(default_factory=dict)  # window -> [B, 1, 1, S], built once per step

    @classmethod
    def build(cls, batch: AttentionBatch, block_size: int, device: torch.device, every_row: bool) -> PagedMetadata:
        """every_row: every row is a one-row query over the cache, as the CPU kernel reads it;
        else a sequence with several new tokens attends as one prefill slice."""
        starts, lens, tables = batch.query_start_loc, batch.seq_lens, batch.block_tables
        counts = [end - start for start, end in zip(starts, starts[1:])]  # each sequence's new tokens
        # sequences whose rows are one-row queries: all, or those with one new token (decodes)
        row_seqs = range(len(lens)) if every_row else [i for i, n in enumerate(counts) if n == 1]
        prefills = [] if every_row else [
            PrefillSlice(starts[i], n, lens[i], [index_tensor(t[i][:-(-lens[i] // block_size)], device) for t in tables])
            for i, n in enumerate(counts) if n > 1]
        meta = cls([index_tensor(slots, device) for slots in batch.slot_mapping], prefills, None, None, None)
        if row_seqs:
            # every row: its sequence's block tables (padded to one width) and the keys it sees (its position + 1)
            ctx = [p + 1 for p in batch.positions] if every_row else [lens[i] for i in row_seqs]
            max_ctx = max(ctx)
            width = -(-max_ctx // block_size)
            meta.decode_tables = []
            for group_tables in tables:
                row_tables = []
                for i in row_seqs:
                    row_tables.extend([(group_tables[i] + [0] * width)[:width]] * counts[i])
                meta.decode_tables.append(index_tensor(row_tables, device))
            meta.decode_rows = (torch.arange(starts[-1], device=device) if every_row
                                else index_tensor([starts[i] for i in row_seqs], device))
            meta.decode_ctx = index_tensor(ctx, device).unsqueeze(1)
            meta.decode_max_ctx = max_ctx
        return meta

    def decode_mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self._decode_masks:
            S = self.decode_tables[0].shape[1] * block_size
            key_pos = torch.arange(S, device=self.decode_ctx.device)
            mask = key_pos < self.decode_ctx
            if window is not None:
                mask &= key_pos > self.decode_ctx - 1 - window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]


@dataclass
class TorchPagedAttention(AttentionBackend):
    every_row_reads_the_cache = False  # prefill chunks attend in slices (SDPA); only decodes go row by row

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True  # whatever PyTorch runs on

    def prepare(self, batch: AttentionBatch) -> PagedMetadata:
        return PagedMetadata.build(batch, self.cache.block_size, self.cache.device, self.every_row_reads_the_cache)

    def forward(self, layer, q, k, v, meta: PagedMetadata):
        kc, vc = self.cache.layer(layer)  # [blocks, block_size, Hkv, D'] (kv_cache.py)
        g = self.cache.group_of(layer)
        nb, bs, H, Ds = kc.shape
        # k and v as stored (a bf16 cache under fp32 activations rounds them, q8_0 quantises
        # them), then read back at the queries' dtype: every query attends over the stored values
        rot_k, rot_v = kv_cache.rotations(kc.dtype, q.shape[-1])  # (q8_0: attention in the rotated space)
        q = kv_cache.rotate(q, rot_k)
        k, v = kv_cache.store(k, kc.dtype, rot_k), kv_cache.store(v, vc.dtype, rot_v)
        kc.view(nb * bs, H, Ds).index_copy_(0, meta.slot_mapping[g], k)
        vc.view(nb * bs, H, Ds).index_copy_(0, meta.slot_mapping[g], v)
        q = q.contiguous()
        out = torch.empty_like(q)
        p = self.params[layer]
        for s in meta.prefills:
            rows = slice(s.q_start, s.q_start + s.q_len)
            if s.ctx_len == s.q_len:  # nothing cached before this chunk: its own k/v are all the keys
                keys, vals = k[rows], v[rows]
            else:  # index_select copies whole blocks; it is several times faster than fancy indexing
                keys = kc.index_select(0, s.tables[g]).view(-1, H, Ds)[:s.ctx_len]
                vals = vc.index_select(0, s.tables[g]).view(-1, H, Ds)[:s.ctx_len]
            keys, vals = kv_cache.read(keys, q.dtype), kv_cache.read(vals, q.dtype)
            if s.ctx_len == s.q_len and (p.window is None or p.window >= s.q_len):
                out[rows] = sdpa(q[rows], keys, vals, None, p, causal=True)
            else:
                out[rows] = sdpa(q[rows], keys, vals, s.mask(p.window), p)
        if meta.decode_rows is not None:
            self.decode(layer, q, out, kc, vc, meta.decode_tables[g], meta)
        return kv_cache.rotate(out, rot_v)

    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               tables: torch.Tensor, meta: PagedMetadata) -> None:
        """The one-token rows: their blocks (`tables`: in this layer's group) gathered into one padded batch."""
        B = meta.decode_rows.shape[0]
        _, bs, H, Ds = kc.shape
        flat = tables.view(-1)
        keys = kv_cache.read(kc.index_select(0, flat).view(B, -1, H, Ds), q.dtype).transpose(1, 2)  # [B, Hkv, S, D]
        vals = kv_cache.read(vc.index_select(0, flat).view(B, -1, H, Ds), q.dtype).transpose(1, 2)
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, D]
        p = self.params[layer]
        out[meta.decode_rows] = attend(qd, keys, vals, meta.decode_mask(p.window, bs), p).squeeze(2)
