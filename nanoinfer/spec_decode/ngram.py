"""Prompt lookup (n-gram) proposals: find the most recent earlier place where the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred, and propose the
tokens that followed it there. Free to compute, and right often where the output copies its
input: editing code, quoting a document, chat that repeats its context."""
from __future__ import annotations

import numpy as np

from .config import SpeculativeConfig
from .proposer import SeqKey


class NgramProposer:
    guess_cost = 0.0  # a lookup in the sequence's own tokens

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose_many(self, requests: list[tuple[SeqKey, list[int], int]]) -> list[list[int]]:
        """For each (sequence key, its tokens, k): up to k proposed tokens."""
        return [self.propose(tokens, k) for _, tokens, k in requests]

    def retain(self, keys: set[SeqKey]) -> None:
        """Nothing is kept per sequence."""

    def prefill(self, requests: list[tuple[SeqKey, list[int]]]) -> None:
        """Nothing to compute ahead."""

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens (default num_speculative_tokens) to follow `tokens`; [] when no
        n-gram matches."""
        k = self.k if k is None else k
        if k <= 0 or len(tokens) <= self.n_min:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, len(arr) - 1), self.n_min - 1, -1):
            pattern = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence: what followed it
                return arr[start:start + k].tolist()
        return []
