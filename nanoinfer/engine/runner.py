"""Batch -> tensors -> one forward -> logits for the rows that sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionBatch, PagedKVCache, index_tensor, layer_params
from ..config import ModelConfig
from ..distributed.executor import TensorParallelExecutor
from ..models.batch import ForwardBatch
from .batch import ScheduledBatch


@dataclass
class StepRows:
    """Which sequence each row of a step's logits belongs to: first the sampling rows (a
    sequence with proposed tokens has 1 + k, in order), then rows whose logits score prompt
    tokens (`prompt`: sequence index, first position, count; position p's row predicts prompt
    token p + 1). `hidden`: rows whose final hidden states a pooling sequence takes (sequence
    index, first position, count), after all the logits rows."""
    samplers: list[int] = field(default_factory=list)
    prompt: list[tuple[int, int, int]] = field(default_factory=list)
    hidden: list[tuple[int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, config: ModelConfig, cache: PagedKVCache,
                 backend: type[AttentionBackend], executor: TensorParallelExecutor | None = None):
        """config: what this process's attention holds (a tensor-parallel rank: its heads);
        backend: the attention backend's class (attention.backend_class chose it);
        executor: the other ranks, handed each step before this rank runs it."""
        self.model = model
        self.executor = executor
        self.config = config
        self.cache = cache
        self.device = cache.device
        self.attention = backend(layer_params(config), cache)
        # Models that mix in the previous token (nanochat's smear) get its id for every position.
        self.needs_prev_ids = getattr(model, "needs_prev_ids", False)

    def build(self, batch: ScheduledBatch) -> tuple[ForwardBatch, StepRows]:
        """Flatten the batch into one forward, and say which sequences (indices into
        batch.seqs) the logits rows belong to. The attention backend shapes its own
        metadata from the step's AttentionBatch."""
        bs = self.cache.block_size
        num_groups = len(self.cache.groups)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]  # per KV group
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        logits_rows: list[int] = []
        rows = StepRows()
        prompt_rows: list[int] = []
        hidden_rows: list[int] = []
        prev: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.kv.num_computed
            q_start = len(ids)
            spec = len(seq.spec.tokens)  # proposed tokens follow the sequence's own: every one gets logits
            ids.extend(seq.token_slice(start, start + n - spec) + seq.spec.tokens)
            if self.needs_prev_ids:
                prev.extend((seq.token_slice(start - 1, start) if start else [-1]) + ids[q_start:-1])
            positions.extend(range(start, start + n))
            for g, table in enumerate(seq.kv.block_tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                tables[g].append(table)
            starts.append(len(ids))
            seq_lens.append(start + n)
            if start + n - spec == seq.length:  # caught up with its tokens: it samples the next one(s)
                logits_rows.extend(range(len(ids) - 1 - spec, len(ids)))
                rows.samplers.extend([i] * (1 + spec))
            if seq.wants_prompt_logprobs:  # positions whose next token is a prompt token not yet scored
                first, end = max(start, len(seq.prompt_logprobs) - 1), min(start + n, len(seq.prompt_ids) - 1)
                if end > first:
                    rows.prompt.append((i, first, end - first))
                    prompt_rows.extend(range(q_start + first - start, q_start + end - start))
            span = seq.hidden_span(start, start + n)
            if span is not None:
                rows.hidden.append((i, *span))
                hidden_rows.extend(range(q_start + span[0] - start, q_start + span[0] + span[1] - start))
        logits_indices = logits_rows + prompt_rows + hidden_rows
        meta = self.attention.prepare(AttentionBatch(starts, seq_lens, tables, slots, positions, logits_indices))
        forward = ForwardBatch(
            index_tensor(ids, self.device), index_tensor(positions, self.device), self.attention, meta,
            index_tensor(logits_indices, self.device), index_tensor(prev, self.device) if self.needs_prev_ids else None,
        )
        return forward, rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, StepRows, torch.Tensor | None]:
        """Returns logits [rows, vocab] (fp32), whose rows they are, and the hidden states
        [rows, hidden] of rows.hidden (None when no sequence pools). The head runs on the
        logits rows only: a row's logits are the same whether or not others pool beside it."""
        forward, rows = self.build(batch)
        if self.executor is not None:
            self.executor.step(batch.block_copies, forward)
        if not rows.hidden:
            return self.model(forward), rows, None
        hidden = self.model.hidden_states(forward)
        n = len(forward.logits_indices) - sum(count for _, _, count in rows.hidden)
        return self.model.compute_logits(hidden[:n]), rows, hidden[n:]
