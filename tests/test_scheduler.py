"""The scheduler and the block manager without a model: sequences are data."""
from __future__ import annotations

from nanoinfer.engine.scheduler import Scheduler, SchedulerConfig
from nanoinfer.engine.sequence import Sequence
from nanoinfer.sampling import SamplingParams


def seq(rid: str, prompt_len: int, first_token: int = 1) -> Sequence:
    """A sequence the scheduler can place (sampling, text and stop state are not its business)."""
    return Sequence(rid, 0, None, list(range(first_token, first_token + prompt_len)), SamplingParams(), None, None,
                    None, frozenset(), 1 << 20)


def run(s: Scheduler) -> list[str]:
    batch = s.schedule()
    s.update_after_forward(batch)
    return [q.request_id for q in batch.seqs]


def test_a_paused_sequence_is_skipped_keeps_its_place_and_gives_up_its_blocks():
    s = Scheduler(SchedulerConfig(num_blocks=4, max_num_seqs=8, max_num_batched_tokens=64, block_size=4))
    a = seq("a", 8)
    s.add(a)
    assert run(s) == ["a"] and len(a.block_table) == 2
    a.paused = True  # its reader fell behind
    assert run(s) == [] and a.block_table  # not scheduled, blocks kept
    b = seq("b", 12, first_token=100)  # needs 3 blocks: only 2 are free
    s.add(b)
    assert run(s) == ["b"]  # the paused sequence gave its blocks up (preempted, recomputed later)
    assert a in s.waiting and a.num_computed == 0 and not a.block_table
    assert run(s) == ["b"]  # still paused: waiting, skipped
    s.finish(b)
    a.paused = False
    assert run(s) == ["a"] and a.num_computed == 8
