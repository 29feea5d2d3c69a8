"""nanochat's `Engine` API on nanoinfer's batched engine.

    engine = Engine(model, tokenizer)
    for token_column, token_masks in engine.generate(tokens, num_samples=4, max_tokens=64):
        ...                                   # one token per sample row per step
    sequences, masks = engine.generate_batch(tokens, num_samples=4, max_tokens=64)

Same semantics as nanochat's: rows share one prefill and sample their first tokens
independently; mask 1 = sampled, 0 = forced (prompt, tool output); a row ends at
<|assistant_end|> or <|bos|>; temperature 0 is argmax; top_k restricts the softmax.
What is better here: rows that finish stop costing compute, samples share the
prompt's KV blocks instead of copying them, forced tool output is computed in one
forward, and the prefill computes logits for its last position only.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from torch import nn

from ..engine import EngineConfig, LLMEngine
from ..engine.outputs import FinishCause
from ..models.builder import LoadedModel
from ..sampling import SamplingParams


class Engine:
    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig | None = None):
        loaded = LoadedModel(model, tokenizer, model.config, None, "module", 0.0)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(loaded, config)
        self._next_id = 0

    def _submit(self, tokens: list[int], num_samples: int, max_tokens: int | None, temperature: float,
                top_k: int | None, seed: int) -> str:
        rid = f"nanochat-{self._next_id}"
        self._next_id += 1
        params = SamplingParams(n=num_samples, temperature=temperature, top_k=top_k or 0, seed=seed,
                                max_tokens=max_tokens)
        self.engine.add_request(rid, list(tokens), params)
        return rid

    def generate(self, tokens: list[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 42
                 ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (token_column, token_masks): one token per row per step. A row that has
        ended repeats its terminal token (mask 0) until every row has ended."""
        rid = self._submit(tokens, num_samples, max_tokens, temperature, top_k, seed)
        queues = [deque() for _ in range(num_samples)]
        last = [None] * num_samples
        done = [False] * num_samples
        deltas = self.engine.stream(rid)  # steps the engine; raises if the request fails
        try:
            while True:
                # step until every live row has a token ready
                while not all(queues[i] or done[i] for i in range(num_samples)):
                    d = next(deltas, None)
                    if d is None:  # every row has finished
                        done = [True] * num_samples
                        break
                    queues[d.index].extend(zip(d.token_ids, d.token_masks))
                    done[d.index] = d.finished
                if all(done[i] and not queues[i] for i in range(num_samples)):
                    return
                column, masks = [], []
                for i, q in enumerate(queues):
                    if q:
                        last[i], mask = q.popleft()
                    else:
                        mask = 0
                    column.append(last[i])
                    masks.append(mask)
                yield column, masks
        finally:
            self.engine.release(rid)

    def generate_batch(self, tokens: list[int], num_samples: int = 1, **kwargs
                       ) -> tuple[list[list[int]], list[list[int]]]:
        """(sequences, masks): prompt plus generated tokens per row, without the terminal token;
        masks are 0 for the prompt and for forced tokens."""
        rid = self._submit(tokens, num_samples, kwargs.get("max_tokens"), kwargs.get("temperature", 1.0),
                           kwargs.get("top_k"), kwargs.get("seed", 42))
        try:
            for _ in self.engine.stream(rid):  # raises if the request fails
                pass
        finally:
            out = self.engine.release(rid)
        sequences, masks = [], []
        for c in out.outputs:
            ids, m = list(c.token_ids), list(c.token_masks)
            if c.finish_cause is FinishCause.EOS:  # <|assistant_end|> or <|bos|>
                ids, m = ids[:-1], m[:-1]
            sequences.append(list(tokens) + ids)
            masks.append([0] * len(tokens) + m)
        return sequences, masks
