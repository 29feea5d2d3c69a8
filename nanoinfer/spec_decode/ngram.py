"""Prompt lookup (n-gram) proposals: find an earlier place where the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) occurred, and propose the tokens that
followed it there. Free to compute, and right often where the output copies its input:
editing code, quoting a document, chat that repeats its context.

Two refinements over matching raw token ids, both measured on a model quoting a
hard-wrapped document, neither able to change an output (a guess only saves work when the
target samples it anyway):
- Matching ignores whitespace. A model that quotes text often re-flows it: a line break in
  the source becomes a space in the quote, and `foo\\n` becomes `foo` then ` bar`. Compared
  by their text without surrounding whitespace, with whitespace-only tokens left out, the
  quote still lines up with its source after such a change, so one guess misses instead of
  the lookup losing its place for several steps.
- Of several places that match, the one whose preceding text agrees with the sequence's
  for longest wins (then the most recent): a common n-gram ("of the") occurs in many
  places, the one being copied is the one with the same context."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import SpeculativeConfig
from .proposer import SeqKey

CONTEXT_CAP = 32  # how far back (in tokens) two matching places are compared to tell them apart


def word_classes(token_texts: Sequence[str]) -> np.ndarray:
    """Per token id: -1 for a whitespace-only token, else an id shared by the tokens whose
    text is the same once stripped of surrounding whitespace (" blocks", "blocks",
    "blocks\\n"). A token that decodes to a partial UTF-8 character gets a class of its own."""
    ids: dict[str, int] = {}
    out = np.empty(len(token_texts), dtype=np.int64)
    for i, text in enumerate(token_texts):
        word = text.strip()
        if not word and text:
            out[i] = -1
        elif "\ufffd" in text or not text:
            out[i] = len(token_texts) + i  # beyond every shared id
        else:
            out[i] = ids.setdefault(word, len(ids))
    return out


class NgramProposer:
    guess_cost = 0.0  # a lookup in the sequence's own tokens

    def __init__(self, config: SpeculativeConfig, token_texts: Sequence[str] | None = None):
        """`token_texts`: each token id's text, for matching that ignores whitespace; without
        them token ids are matched as they are."""
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min
        self.classes = None if token_texts is None else word_classes(token_texts)

    def propose_many(self, requests: list[tuple[SeqKey, list[int], int]]) -> list[list[int]]:
        """For each (sequence key, its tokens, k): up to k proposed tokens."""
        return [self.propose(tokens, k) for _, tokens, k in requests]

    def retain(self, keys: set[SeqKey]) -> None:
        """Nothing is kept per sequence."""

    def prefill(self, requests: list[tuple[SeqKey, list[int]]]) -> None:
        """Nothing to compute ahead."""

    def _classes(self, arr: np.ndarray) -> np.ndarray:
        """Each token's word class (ids past the vocabulary: a class of their own)."""
        n = len(self.classes)
        return np.where(arr < n, self.classes[np.minimum(arr, n - 1)], 2 * n + arr)

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens (default num_speculative_tokens) to follow `tokens`; [] when no
        n-gram matches."""
        k = self.k if k is None else k
        if k <= 0 or len(tokens) <= self.n_min:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        cls = arr if self.classes is None else self._classes(arr)  # without texts: the ids themselves
        where = np.flatnonzero(cls >= 0)  # the tokens compared: whitespace-only ones left out
        end = _best_match_end(cls[where], self.n_max, self.n_min)
        if end is None:
            return []
        start = int(where[end - 1]) + 1  # right after the last matched token, whitespace included
        if cls[-1] < 0:  # the sequence ends in whitespace already: not the source's too
            while start < len(arr) and cls[start] < 0:
                start += 1
        return arr[start:start + k].tolist()


def _best_match_end(seq: np.ndarray, n_max: int, n_min: int) -> int | None:
    """The index in `seq` just after an earlier occurrence of its last n items (the largest n
    in [n_min, n_max] that occurs): of several, the one preceded by the longest run agreeing
    with what precedes the suffix (up to CONTEXT_CAP), then the latest. None: no match."""
    length = len(seq)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if not hits.size:
            continue
        context = np.zeros(hits.size, dtype=np.int64)
        alive = np.ones(hits.size, dtype=bool)
        for j in range(1, min(CONTEXT_CAP, length - n) + 1):
            before = hits - j
            alive &= before >= 0
            alive[alive] = seq[before[alive]] == seq[length - n - j]
            if not alive.any():
                break
            context += alive
        best = int(np.flatnonzero(context == context.max())[-1])
        return int(hits[best]) + n
    return None
