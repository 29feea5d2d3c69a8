"""Batch -> tensors -> one forward -> logits for the rows that sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention import PagedKVCache, PagedMetadata, PrefillSlice, get_backend, layer_params
from ..config import ModelConfig
from ..distributed.executor import TensorParallelExecutor
from ..models.batch import ForwardBatch
from .batch import ScheduledBatch


@dataclass
class StepRows:
    """Which sequence each row of a step's logits belongs to: first the sampling rows (a
    sequence with proposed tokens has 1 + k, in order), then rows whose logits score prompt
    tokens (`prompt`: sequence index, first position, count; position p's row predicts prompt
    token p + 1)."""
    samplers: list[int] = field(default_factory=list)
    prompt: list[tuple[int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, cache: PagedKVCache,
                 executor: TensorParallelExecutor | None = None):
        """config: what this process's attention holds (a tensor-parallel rank: its heads);
        executor: the other ranks, handed each step before this rank runs it."""
        self.model = model
        self.executor = executor
        self.config = config
        self.cache = cache
        self.device = cache.k.device
        self.attention = get_backend(layer_params(config), cache)
        # Models that mix in the previous token (nanochat's smear) get its id for every position.
        self.needs_prev_ids = getattr(model, "needs_prev_ids", False)

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, StepRows]:
        """Flatten the batch into one forward, and say which sequences (indices into
        batch.seqs) the logits rows belong to."""
        bs = self.cache.block_size
        per_row = self.attention.every_row_reads_the_cache  # every row a one-row query up to its position
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSlice] = []
        row_seqs: list[int] = []  # sequences whose rows are one-row queries
        row_starts: list[int] = []
        logits_rows: list[int] = []
        rows = StepRows()
        prompt_rows: list[int] = []
        prev: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            q_start = len(ids)
            spec = len(seq.spec_tokens)  # proposed tokens follow the sequence's own: every one gets logits
            ids.extend(seq.token_slice(start, start + n - spec) + seq.spec_tokens)
            if self.needs_prev_ids:
                prev.extend((seq.token_slice(start - 1, start) if start else [-1]) + ids[q_start:-1])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if per_row or n == 1:
                row_seqs.append(i)
                row_starts.append(q_start)
            else:
                prefills.append(PrefillSlice(q_start, n, start + n,
                                             torch.tensor(table[:-(-(start + n) // bs)], device=self.device)))
            if start + n - spec == seq.length:  # caught up with its tokens: it samples the next one(s)
                logits_rows.extend(range(len(ids) - 1 - spec, len(ids)))
                rows.samplers.extend([i] * (1 + spec))
            if seq.wants_prompt_logprobs:  # positions whose next token is a prompt token not yet scored
                first, end = max(start, len(seq.prompt_logprobs) - 1), min(start + n, len(seq.prompt_ids) - 1)
                if end > first:
                    rows.prompt.append((i, first, end - first))
                    prompt_rows.extend(range(q_start + first - start, q_start + end - start))
        meta = PagedMetadata(torch.tensor(slots, device=self.device), prefills, None, None, None)
        if row_seqs:
            meta.decode_rows = (torch.arange(len(ids), device=self.device) if per_row
                                else torch.tensor(row_starts, device=self.device))
            meta.decode_tables, meta.decode_ctx, meta.decode_max_ctx = self._row_metadata(batch, row_seqs)
        forward = ForwardBatch(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.attention, meta,
            torch.tensor(logits_rows + prompt_rows, dtype=torch.long, device=self.device),
            torch.tensor(prev, device=self.device) if self.needs_prev_ids else None,
        )
        return forward, rows

    def _row_metadata(self, batch: ScheduledBatch, which: list[int]):
        """For every row of the sequences `which` (in order): its sequence's block table
        (padded to one width), the keys it sees (its position + 1), and the largest of those."""
        bs = self.cache.block_size
        seqs = [(batch.seqs[i], batch.num_tokens[i]) for i in which]
        width = max(-(-(seq.num_computed + n) // bs) for seq, n in seqs)
        tables, ctx = [], []
        for seq, n in seqs:
            tables.extend([(seq.block_table + [0] * width)[:width]] * n)
            ctx.extend(range(seq.num_computed + 1, seq.num_computed + n + 1))
        return (torch.tensor(tables, device=self.device),
                torch.tensor(ctx, device=self.device).unsqueeze(1), max(ctx))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepRows]:
        """Returns logits [rows, vocab] (fp32) and whose rows they are."""
        forward, rows = self.build(batch)
        if self.executor is not None:
            self.executor.step(batch.block_copies, forward)
        return self.model(forward), rows
