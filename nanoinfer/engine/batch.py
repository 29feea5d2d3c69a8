"""One step's decision, from the scheduler to the runner: which sequences run, how many
tokens each computes, and the block copies (copy-on-write) to make before the forward."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    # per KV group, (src, dst) block copies: copy-on-write before the forward
    block_copies: list[list[tuple[int, int]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)
