"""The draft-model proposer: a smaller model with the same vocabulary guesses the next k
tokens of each speculating sequence, greedily, in its own paged KV cache.

Each target sequence gets a draft sequence (its tokens, its block table in the draft's
pool). Before a step the draft catches up with what the target accepted since the last
step (the KV of its rejected guesses is simply overwritten: only the positions whose
tokens still agree with the target count as computed), then runs k single-token steps,
every speculating sequence in one batch. It lives in the engine package because it runs a
model through the engine's own runner and block manager, as the target does."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..attention import AttentionBackend, PagedKVCache
from ..attention.kv_cache import kv_groups
from ..errors import InvalidRequestError
from ..kernels.quant_linear import has_block_weights
from ..models.builder import LoadedModel, load_model
from ..spec_decode import SeqKey, SpeculativeConfig
from .batch import ScheduledBatch
from .kv_manager import GroupSpec, KVCacheManager
from .runner import ModelRunner
from .sequence import KVPlacement, Speculation


@dataclass
class DraftSequence:
    """What the runner reads of a sequence, for the draft model's copy of a target sequence."""

    tokens: list[int]
    kv: KVPlacement = field(default_factory=KVPlacement)  # in the draft's pool; num_computed: its valid draft KV
    spec: Speculation = field(default_factory=Speculation)  # always empty: the draft does not speculate
    wants_prompt_logprobs = False  # nor score prompts

    def hidden_span(self, start: int, end: int) -> None:
        return None  # nor pool them

    @property
    def length(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def stored_bytes(path: Path) -> int:
    """The size of a model's weights on disk: a GGUF file, or a folder's weight files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".pt", ".bin", ".gguf"))


def same_vocabulary(a, b) -> bool:
    return a.vocab_size == b.vocab_size and all(a.id_to_token(i) == b.id_to_token(i) for i in range(a.vocab_size))


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: LoadedModel, num_blocks: int, block_size: int,
                 max_model_len: int, kv_dtype: torch.dtype, backend: type[AttentionBackend]):
        """num_blocks: as many as the target's largest pool; backend: the target's attention
        backend (same device, same KV dtype). One KV group: a draft's windowed layers keep every
        block (the draft's pool is small; its sequences are given back as soon as they stop)."""
        device = next(target.model.parameters()).device
        dtype = None if has_block_weights(target.model) else next(target.model.parameters()).dtype
        self.loaded = draft = load_model(config.model, dtype=dtype, device=device)
        if not same_vocabulary(draft.tokenizer, target.tokenizer) or draft.config.vocab_size > target.config.vocab_size:
            raise InvalidRequestError(f"the draft model {config.model} does not share the target's vocabulary",
                                      param="speculative_config.model")
        mc = draft.config
        groups = kv_groups(mc.windows(), max_model_len, by_window=False)
        self.cache = PagedKVCache.allocate(groups, [num_blocks], block_size, mc.num_kv_heads, mc.head_dim, kv_dtype, device)
        self.blocks = KVCacheManager([GroupSpec(None, num_blocks)], block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(draft.model, mc, self.cache, backend)
        self.max_len = min(max_model_len, mc.max_position_embeddings)
        if hasattr(draft.model, "set_context"):
            draft.model.set_context(self.max_len)
        self.seqs: dict[SeqKey, DraftSequence] = {}
        # a guess is one forward of the draft, which at decode sizes costs what reading its weights does
        self.guess_cost = stored_bytes(draft.path) / max(1, stored_bytes(target.path))

    def retain(self, keys: set[SeqKey]) -> None:
        """Forget the draft sequences of target sequences that are no longer running."""
        for key in [k for k in self.seqs if k not in keys]:
            self.blocks.free(self.seqs.pop(key).kv)

    def prefill(self, requests: list[tuple[SeqKey, list[int]]]) -> None:
        """Compute the draft's KV of these sequences' tokens now (in the step that prefilled the
        target, so that the draft's prompt counts in the time to the first token)."""
        live = [d for key, tokens in requests
                if len(tokens) <= self.max_len and self._reserve(d := self._sync(key, tokens), len(tokens))]
        live = [d for d in live if d.kv.num_computed < d.length - 1]  # the last token waits: its logits guess
        if live:
            with torch.inference_mode():
                self.runner.run(ScheduledBatch(live, [d.length - 1 - d.kv.num_computed for d in live]))
            for d in live:
                d.kv.num_computed = d.length - 1

    def propose_many(self, requests: list[tuple[SeqKey, list[int], int]]) -> list[list[int]]:
        """For each (key, the target's tokens, k): up to k greedy guesses of the draft model
        (fewer where its pool or context has no room)."""
        live: list[tuple[int, DraftSequence, int]] = []
        for i, (key, tokens, k) in enumerate(requests):
            d = self._sync(key, tokens)
            if k > 0 and len(tokens) + k <= self.max_len and self._reserve(d, len(tokens) + k - 1):
                live.append((i, d, k))
        out: list[list[int]] = [[] for _ in requests]
        for j in range(max((k for _, _, k in live), default=0)):
            step = [(i, d) for i, d, k in live if j < k]
            batch = ScheduledBatch([d for _, d in step], [d.length - d.kv.num_computed for _, d in step])
            with torch.inference_mode():
                logits, _, _ = self.runner.run(batch)
            best = logits.float().cpu().numpy().argmax(-1)
            for (i, d), t in zip(step, best.tolist()):
                d.kv.num_computed = d.length
                d.tokens.append(t)
                out[i].append(t)
        return out

    def _sync(self, key: SeqKey, tokens: list[int]) -> DraftSequence:
        d = self.seqs.get(key)
        if d is None:
            d = self.seqs[key] = DraftSequence(list(tokens))
            return d
        n = min(d.kv.num_computed, len(tokens))
        a, b = np.asarray(d.tokens[:n]), np.asarray(tokens[:n])
        diff = np.flatnonzero(a != b)
        d.kv.num_computed = min(int(diff[0]) if diff.size else n, len(tokens) - 1)  # the last one gives logits
        d.tokens = list(tokens)
        return d

    def _reserve(self, d: DraftSequence, length: int) -> bool:
        """Blocks for `length` tokens; False (and the draft's blocks given back) if the pool has none."""
        if not self.blocks.allocate_slots(d.kv, max(0, length - d.kv.num_computed)):
            self.blocks.free(d.kv)
            d.kv.num_computed = 0
            return False
        return True
