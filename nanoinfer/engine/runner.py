"""Batch -> tensors -> one forward -> logits for the rows that sample."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import PagedKVCache, PagedMetadata, PrefillSlice, get_backend, layer_params
from ..config import ModelConfig
from ..models.batch import ForwardBatch
from .batch import ScheduledBatch


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, cache: PagedKVCache):
        self.model = model
        self.config = config
        self.cache = cache
        self.device = cache.k.device
        self.attention = get_backend(layer_params(config), cache)
        # Models that mix in the previous token (nanochat's smear) get its id for every position.
        self.needs_prev_ids = getattr(model, "needs_prev_ids", False)

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[int]]:
        """Flatten the batch into one forward, and say which sequences (indices into
        batch.seqs) the logits rows belong to."""
        bs = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSlice] = []
        decode_rows: list[int] = []
        decode_seqs: list[int] = []
        logits_rows: list[int] = []
        samplers: list[int] = []
        prev: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            q_start = len(ids)
            ids.extend(seq.token_slice(start, start + n))
            if self.needs_prev_ids:
                prev.extend(seq.token_slice(start - 1, start + n - 1) if start else [-1] + ids[q_start:-1])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(q_start)
                decode_seqs.append(i)
            else:
                prefills.append(PrefillSlice(q_start, n, start + n,
                                             torch.tensor(table[:-(-(start + n) // bs)], device=self.device)))
            if start + n == seq.length:  # caught up with its tokens: it samples the next one
                logits_rows.append(len(ids) - 1)
                samplers.append(i)
        meta = PagedMetadata(torch.tensor(slots, device=self.device), prefills, None, None, None)
        if self.attention.every_row_reads_the_cache:  # every row a one-row query up to its own position
            meta.prefills = []
            meta.decode_rows = torch.arange(len(ids), device=self.device)
            meta.decode_tables, meta.decode_ctx, meta.decode_max_ctx = self._row_metadata(batch)
        elif decode_rows:
            meta.decode_rows = torch.tensor(decode_rows, device=self.device)
            meta.decode_tables, meta.decode_ctx, meta.decode_max_ctx = self._decode_metadata(batch, decode_seqs)
        forward = ForwardBatch(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.attention, meta,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            torch.tensor(prev, device=self.device) if self.needs_prev_ids else None,
        )
        return forward, samplers

    def _decode_metadata(self, batch: ScheduledBatch, which: list[int]):
        """Block tables padded to one width, each row's context length, and the longest."""
        bs = self.cache.block_size
        ctx = [batch.seqs[i].num_computed + 1 for i in which]
        width = max(-(-c // bs) for c in ctx)
        tables = [(batch.seqs[i].block_table + [0] * width)[:width] for i in which]
        return (torch.tensor(tables, device=self.device),
                torch.tensor(ctx, device=self.device).unsqueeze(1), max(ctx))

    def _row_metadata(self, batch: ScheduledBatch):
        """For every row of the flat batch: its sequence's block table (padded to one width),
        the keys it sees (its position + 1), and the largest of those."""
        bs = self.cache.block_size
        width = max(-(-(seq.num_computed + n) // bs) for seq, n in zip(batch.seqs, batch.num_tokens))
        tables, ctx = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            table = (seq.block_table + [0] * width)[:width]
            tables.extend([table] * n)
            ctx.extend(range(seq.num_computed + 1, seq.num_computed + n + 1))
        return (torch.tensor(tables, device=self.device),
                torch.tensor(ctx, device=self.device).unsqueeze(1), max(ctx))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns logits [num_sampling, vocab] (fp32) and the batch indices they belong to."""
        forward, samplers = self.build(batch)
        return self.model(forward), samplers
