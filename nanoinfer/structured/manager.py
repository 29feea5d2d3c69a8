"""One engine's structured outputs: the grammar backend (built on first use: reading a 50k
vocabulary takes llguidance a few hundred milliseconds), compiled constraints cached by their
text, and the step's masks applied to the logits before anything samples from them."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from ..sampling import StructuredOutputsParams
from ..tokenizer import TokenizerLike
from .backend import Compiled, GrammarBackend, Matcher

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped)


class StructuredOutputs:
    def __init__(self, tokenizer: TokenizerLike, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._lock = threading.Lock()  # compile() is called from the server's worker threads too
        self.mask_seconds = 0.0  # time spent computing and applying masks (the bench reports it)
        self.mask_rows = 0

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            from .llguidance_backend import LLGuidanceBackend, make_tokenizer

            eos = sorted(self.tokenizer.eos_token_ids)
            self._backend = LLGuidanceBackend(make_tokenizer(self.tokenizer.vocabulary_source(), self.vocab_size, eos))
        return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled constraint, from the cache when the same text was compiled before.
        Raises InvalidRequestError for a constraint the backend cannot handle."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            backend = self.backend
        compiled = backend.compile(spec)  # outside the lock: other threads may compile other specs
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        return self.compile(spec).matcher()

    def apply_masks(self, logits: torch.Tensor, rows: list[tuple[int, Matcher]]) -> list[int]:
        """Set to -inf every logit of rows[i][0] that its matcher disallows (logits: CPU fp32
        [R, V]). Returns the rows whose grammar allows no token at all (their requests fail)."""
        t0 = time.perf_counter()
        V = logits.shape[1]
        words = np.zeros((len(rows), (V + 31) // 32), dtype=np.uint32)
        for i, (_, m) in enumerate(rows):
            m.fill_mask(words[i])
        allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
        lg = logits.numpy()
        index = [r for r, _ in rows]
        sub = lg[index]
        sub[~allowed] = -np.inf
        lg[index] = sub
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += len(rows)
        return [r for (r, _), ok in zip(rows, allowed.any(axis=1)) if not ok]
