"""What the engine asks of a proposer (NgramProposer here, the draft model in engine/draft.py).
A sequence is named by its key, (request id, sample index)."""
from __future__ import annotations

from typing import Protocol

SeqKey = tuple[str, int]


class Proposer(Protocol):
    guess_cost: float  # what one guess costs to make, in single-token steps of the target (n-gram lookup: 0)

    def propose_many(self, requests: list[tuple[SeqKey, list[int], int]]) -> list[list[int]]:
        """For each (key, the sequence's tokens, k): up to k guesses of the tokens that follow."""
        ...

    def prefill(self, requests: list[tuple[SeqKey, list[int]]]) -> None:
        """These sequences have just been prefilled: do any per-sequence work ahead of decoding."""
        ...

    def retain(self, keys: set[SeqKey]) -> None:
        """Only these sequences are still running: forget the others."""
        ...
