"""Scheduling policies: the order in which waiting requests are admitted, and which running
sequence gives up its blocks when the pool runs out. The scheduler's mechanics (the token
budget, blocks, copy-on-write, forks, speculative tokens, paused readers) are the same under
every policy; a policy only orders.

- FCFS: first come, first served; the newest running sequence is preempted, and goes back
  to the front of the queue.
- Priority (vLLM's `priority` request field): a lower value is served first, arrival order
  among equals; the running sequence with the highest value (the latest among equals) is
  preempted, and waits in its place by (priority, arrival).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import ClassVar

from ..errors import InvalidRequestError
from .sequence import Sequence


class SchedulingPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def enqueue(self, waiting: deque[Sequence], seq: Sequence, returning: bool = False) -> None:
        """Put seq in the waiting queue. returning: it waited or ran before (preempted, or set
        aside while its reader is behind)."""

    @abstractmethod
    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence (of candidates, in admission order) to preempt."""


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, returning: bool = False) -> None:
        if returning:
            waiting.appendleft(seq)
        else:
            waiting.append(seq)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, returning: bool = False) -> None:
        key = (seq.sched.priority, seq.sched.arrival)
        i = next((i for i, s in enumerate(waiting) if (s.sched.priority, s.sched.arrival) > key), len(waiting))
        waiting.insert(i, seq)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(reversed(candidates), key=lambda s: (s.sched.priority, s.sched.arrival))


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}


def policy_named(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise InvalidRequestError(f"scheduling_policy must be one of {', '.join(sorted(POLICIES))}, got {name!r}",
                                  param="scheduling_policy")
    return POLICIES[name]()
