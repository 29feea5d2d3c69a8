"""Who runs this step, and how many tokens each: one token budget for decodes and prefill chunks.

vLLM V1's idea: a step is a map {sequence: tokens to compute}. A decode asks for 1; a
prompt asks for the rest of its prompt, cut to what the budget leaves (chunked
prefill). So a long prompt is prefilled over several steps while the others keep
decoding, and prefix caching simply starts a prompt with some tokens already computed.

Order: running sequences first (oldest first), then waiting ones (FCFS). When the KV
pool has no block for a running sequence, the newest running sequence is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed.
A paused sequence (its reader has fallen behind) is skipped, wherever it is, and keeps its place.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .batch import ScheduledBatch
from .kv_manager import BlockManager
from .sequence import Sequence


@dataclass
class SchedulerConfig:
    num_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def num_seats(self) -> int:
        """Running sequences and the forks they will make: what max_num_seqs bounds."""
        return len(self.running) + sum(len(seq.forks) for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable(self) -> bool:
        """Whether a step would run anything: some sequence is not paused."""
        return any(not s.paused for s in self.running) or any(not s.paused for s in self.waiting)

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to compute num_tokens more tokens, a copy-on-write included."""
        table = seq.block_table
        end = seq.num_computed + num_tokens
        need = max(0, self.blocks.blocks_needed(end) - len(table))
        idx = seq.num_computed // self.blocks.block_size
        if idx < len(table) and self.blocks.is_shared(table[idx]):
            need += 1
        return need

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV, keep its tokens (prompt and output so far)."""
        self.blocks.free_table(seq.block_table)
        seq.num_computed = 0
        seq.block_hashes.clear()
        seq.spec_tokens.clear()  # guesses ride only on a decode; it comes back as a prefill
        seq.spec_states.clear()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.paused:
                i += 1
                continue
            if seq.spec_tokens:  # a decode with proposed tokens: the guesses ride along, budget permitting
                del seq.spec_tokens[max(0, budget - (seq.length - seq.num_computed)):]
            n = min(seq.length - seq.num_computed + len(seq.spec_tokens), budget)
            while not self.blocks.can_allocate(self._blocks_for(seq, n)) and self.running[-1] is not seq:
                self.preempt(self.running[-1])
            if not self.blocks.can_allocate(self._blocks_for(seq, n)):
                self.preempt(seq)  # nothing newer left to take blocks from
                break
            self._reserve(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        # 2. waiting sequences, first come first served, while budget and blocks last
        paused = [s for s in self.waiting if s.paused]
        if paused:  # aside while the others are served, then back in their places at the front
            self.waiting = deque(s for s in self.waiting if not s.paused)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.num_seats() + 1 + len(seq.forks) > self.config.max_num_seqs:
                break  # its n-1 forks join the running set after its prefill: they count from now
            if not seq.block_table:
                seq.num_computed = self.blocks.allocate_prompt(seq.block_table, seq.all_ids,
                                                               lookup=not seq.wants_prompt_logprobs)
            n = min(seq.length - seq.num_computed, budget)
            # A paused sequence's blocks are the first to give up for one that can run.
            while not self.blocks.can_allocate(self._blocks_for(seq, n)) and any(s.paused for s in self.running):
                self.preempt(next(s for s in reversed(self.running) if s.paused))
                paused.append(self.waiting.popleft())  # aside with the others: it waits for its reader
            if not self.blocks.can_allocate(self._blocks_for(seq, n)):
                if not self.running:
                    # alone and still no room: the pool is smaller than this prompt chunk
                    n = self._shrink_to_fit(seq, n)
                if n == 0 or not self.blocks.can_allocate(self._blocks_for(seq, n)):
                    self.blocks.free_table(seq.block_table)  # give back prefix hits; retry next step
                    seq.num_computed = 0
                    break
            self.waiting.popleft()
            self.running.append(seq)
            self._reserve(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(paused))
        batch.block_copies = self.blocks.take_pending_copies()
        return batch

    def update_after_forward(self, batch: ScheduledBatch) -> None:
        """The forward computed the scheduled tokens: advance each sequence and name the
        blocks it filled, for later prefix hits."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.advance(seq, n - len(seq.spec_tokens))  # proposed tokens count once they are accepted

    def advance(self, seq: Sequence, n: int) -> None:
        """n more of the sequence's tokens have their KV in its blocks (a forward computed
        them, or proposed tokens were accepted)."""
        seq.num_computed += n
        if self.blocks.enable_prefix_caching and seq.num_computed // self.blocks.block_size > len(seq.block_hashes):
            self.blocks.seal_full_blocks(seq.block_table, seq.all_ids, seq.num_computed, seq.block_hashes)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A sample of the same prompt joins the running set, sharing the parent's blocks."""
        child.block_table = self.blocks.fork(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed = parent.num_computed
        child.stats.forwards = list(parent.stats.forwards)
        self.running.append(child)

    def _shrink_to_fit(self, seq: Sequence, n: int) -> int:
        while n > 0 and not self.blocks.can_allocate(self._blocks_for(seq, n)):
            n -= self.blocks.block_size
        return max(n, 0)

    def _reserve(self, seq: Sequence, n: int) -> None:
        if seq.num_computed // self.blocks.block_size < len(seq.block_table):
            self.blocks.prepare_write(seq.block_table, seq.num_computed)
        self.blocks.ensure_slots(seq.block_table, seq.num_computed + n)

    def finish(self, seq: Sequence) -> None:
        self.blocks.free_table(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
