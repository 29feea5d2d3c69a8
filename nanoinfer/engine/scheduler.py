"""Who runs this step, and how many tokens each: one token budget for decodes and prefill chunks.

vLLM V1's idea: a step is a map {sequence: tokens to compute}. A decode asks for 1; a
prompt asks for the rest of its prompt, cut to what the budget leaves (chunked
prefill). So a long prompt is prefilled over several steps while the others keep
decoding, and prefix caching simply starts a prompt with some tokens already computed.

Order: running sequences that decode first, then running ones still prefilling (each in
admission order), then waiting ones in the policy's order (engine/policy.py: FCFS, or
priority). Prefill chunks share what the pacer (engine/pacing.py) leaves of a step's time
target once the decodes are counted, so a prompt never stalls the streams that decode. When
the KV pool has no block for a running sequence, the policy names one to preempt: its blocks
are freed and it waits again, to be recomputed.
A paused sequence (its reader has fallen behind) is skipped, wherever it is, and keeps its place.

The scheduler reaches blocks through the KV manager's doors only (kv_manager.KVCacheManager,
every KV group at once): allocate_prompt (the cached prefix of a new prompt), allocate_slots
(room for a step's tokens), fork, free, seal (name full blocks for later prefix hits) and
take_pending_copies.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from .batch import ScheduledBatch
from .kv_manager import BlockTier, GroupSpec, KVCacheManager
from .pacing import StepPacer
from .policy import SchedulingPolicy, policy_named
from .sequence import Sequence


@dataclass
class SchedulerConfig:
    num_blocks: int | list[GroupSpec]  # one pool of full-attention blocks, or each KV group's
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # engine/policy.py: "fcfs" or "priority"
    step_time_target_s: float | None = None  # engine/pacing.py; None: the token budget alone


class Scheduler:
    def __init__(self, config: SchedulerConfig, policy: SchedulingPolicy | None = None,
                 tiers: list[BlockTier | None] | None = None):
        """tiers: per KV group, where full blocks are also kept, past the pool (the persistent prefix cache)."""
        self.config = config
        self.policy = policy or policy_named(config.policy)
        groups = config.num_blocks if isinstance(config.num_blocks, list) else [GroupSpec(None, config.num_blocks)]
        self.blocks = KVCacheManager(groups, config.block_size, config.enable_prefix_caching, tiers)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self.pacer = StepPacer(config.step_time_target_s)

    def add(self, seq: Sequence) -> None:
        seq.sched.arrival = next(self._arrivals)
        for fork in seq.forks:
            fork.sched.arrival, fork.sched.priority = seq.sched.arrival, seq.sched.priority
        self.policy.enqueue(self.waiting, seq)

    def num_seats(self) -> int:
        """Running sequences and the forks they will make: what max_num_seqs bounds."""
        return len(self.running) + sum(len(seq.forks) for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Whether a step would run anything: some sequence is not paused."""
        return any(not s.sched.paused for s in self.running) or any(not s.sched.paused for s in self.waiting)

    def preempt(self, seq: Sequence, requeue: bool = True) -> None:
        """Recompute later: drop its KV, keep its tokens (prompt and output so far)."""
        self.blocks.free(seq.kv)
        seq.kv.num_computed = 0
        seq.kv.block_hashes.clear()
        seq.spec.tokens.clear()  # guesses ride only on a decode; it comes back as a prefill
        seq.spec.states.clear()
        self.running.remove(seq)
        if requeue:
            self.policy.enqueue(self.waiting, seq, returning=True)
        self.num_preemptions += 1
        seq.sched.num_preemptions += 1

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """Its next token (and any guesses) is all it computes this step: a decode, not a prefill."""
        return seq.length - seq.kv.num_computed <= 1

    def _allocate(self, seq: Sequence, n: int) -> bool:
        return self.blocks.allocate_slots(seq.kv, n)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        # 1. running sequences, decodes first (each in admission order); the policy's victim gives
        # up its blocks when they run out (one not scheduled yet in this step: this one or later)
        order = [s for s in self.running if not s.sched.paused]
        order.sort(key=lambda s: not self._decodes(s))
        prefill = None  # prompt tokens left for this step, set once the decodes are placed
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            if seq.spec.tokens:  # a decode with proposed tokens: the guesses ride along, budget permitting
                del seq.spec.tokens[max(0, budget - (seq.length - seq.kv.num_computed)):]
            n = min(seq.length - seq.kv.num_computed + len(seq.spec.tokens), budget)
            if not self._decodes(seq):
                if prefill is None:
                    prefill = self.pacer.prefill_budget(batch.total_tokens, budget)
                n = min(n, prefill)
                if n == 0:
                    break
            while not self._allocate(seq, n):
                placed = set(map(id, batch.seqs))
                victim = self.policy.victim([s for s in self.running if id(s) not in placed])
                self.preempt(victim)
                order = [s for s in order if s is not victim]
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
                if prefill is not None:
                    prefill -= n
                i += 1
        if prefill is None:
            prefill = self.pacer.prefill_budget(batch.total_tokens, budget)
        budget = min(budget, prefill)  # what is left is for prompts
        # 2. waiting sequences in the policy's order, while budget and blocks last
        paused = [s for s in self.waiting if s.sched.paused]
        if paused:  # aside while the others are served, then back in their places
            self.waiting = deque(s for s in self.waiting if not s.sched.paused)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.num_seats() + 1 + len(seq.forks) > self.config.max_num_seqs:
                break  # its n-1 forks join the running set after its prefill: they count from now
            if not any(seq.kv.block_tables):
                seq.kv.num_computed = self.blocks.allocate_prompt(seq.kv, seq.all_ids, lookup=not seq.needs_every_position)
            n = min(seq.length - seq.kv.num_computed, budget)
            placed = self._allocate(seq, n)
            # A paused sequence's blocks are the first to give up for one that can run.
            while not placed and any(s.sched.paused for s in self.running):
                victim = self.policy.victim([s for s in self.running if s.sched.paused])
                self.preempt(victim, requeue=False)
                paused.append(victim)  # aside with the others: it waits for its reader
                placed = self._allocate(seq, n)
            if not placed:
                # alone and still no room: the pool is smaller than this prompt chunk
                n = 0 if self.running else self._shrink_to_fit(seq, n)
                if n == 0:
                    self.blocks.free(seq.kv)  # give back prefix hits; retry next step
                    seq.kv.num_computed = 0
                    break
            self.waiting.popleft()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        for seq in reversed(paused):
            self.policy.enqueue(self.waiting, seq, returning=True)
        batch.block_copies = self.blocks.take_pending_copies()
        return batch

    def update_after_forward(self, batch: ScheduledBatch) -> None:
        """The forward computed the scheduled tokens: advance each sequence and name the
        blocks it filled, for later prefix hits."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.advance(seq, n - len(seq.spec.tokens))  # proposed tokens count once they are accepted

    def advance(self, seq: Sequence, n: int) -> None:
        """n more of the sequence's tokens have their KV in its blocks (a forward computed
        them, or proposed tokens were accepted)."""
        seq.kv.num_computed += n
        if self.blocks.enable_prefix_caching and seq.kv.num_computed // self.blocks.block_size > len(seq.kv.block_hashes):
            self.blocks.seal(seq.kv, seq.all_ids)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A sample of the same prompt joins the running set, sharing the parent's blocks."""
        self.blocks.fork(parent.kv, child.kv)
        child.sched.priority, child.sched.arrival = parent.sched.priority, parent.sched.arrival
        child.stats.forwards = list(parent.stats.forwards)
        self.running.append(child)

    def _shrink_to_fit(self, seq: Sequence, n: int) -> int:
        """The longest chunk, a whole number of blocks shorter, that the pool has room for (placed)."""
        while n > 0:
            n -= self.blocks.block_size
            if n > 0 and self._allocate(seq, n):
                return n
        return 0

    def finish(self, seq: Sequence) -> None:
        self.blocks.free(seq.kv)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
