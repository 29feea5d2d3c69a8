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
    assert run(s) == ["a"] and len(a.kv.block_table) == 2
    a.sched.paused = True  # its reader fell behind
    assert run(s) == [] and a.kv.block_table  # not scheduled, blocks kept
    b = seq("b", 12, first_token=100)  # needs 3 blocks: only 2 are free
    s.add(b)
    assert run(s) == ["b"]  # the paused sequence gave its blocks up (preempted, recomputed later)
    assert a in s.waiting and a.kv.num_computed == 0 and not a.kv.block_table
    assert run(s) == ["b"]  # still paused: waiting, skipped
    s.finish(b)
    a.sched.paused = False
    assert run(s) == ["a"] and a.kv.num_computed == 8


def make(num_blocks: int, policy: str = "fcfs", max_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=max_tokens,
                                     block_size=4, policy=policy))


def decode(s: Scheduler, token: int = 7) -> list[str]:
    """A step in which every scheduled sequence that finished its prompt gets a token."""
    batch = s.schedule()
    s.update_after_forward(batch)
    for q in batch.seqs:
        if q.kv.num_computed == q.length:
            q.output_ids.append(token)
    return [q.request_id for q in batch.seqs]


def test_admission_is_first_come_first_served_within_budget_and_seats():
    s = make(64, max_tokens=20)
    for i, n in enumerate([8, 8, 8]):
        s.add(seq(f"r{i}", n, first_token=100 * i))
    assert decode(s) == ["r0", "r1", "r2"]  # 8 + 8 + 4 (a chunk of r2's prompt)
    assert [q.kv.num_computed for q in s.running] == [8, 8, 4]
    assert decode(s) == ["r0", "r1", "r2"] and s.running[2].kv.num_computed == 8


def test_preemption_order_follows_the_policy():
    """Blocks run out for the oldest sequence: FCFS takes the newest's blocks, priority the
    highest value's (the latest among equals); the victim is recomputed later, not lost."""
    for policy, priorities, victim in [("fcfs", [0, 0, 0], "c"), ("priority", [0, 5, 1], "b"),
                                       ("priority", [2, 2, 2], "c")]:
        s = make(7, policy)
        seqs = [seq(n, 8, 100 * i) for i, n in enumerate("abc")]
        for q, p in zip(seqs, priorities):
            q.sched.priority = p
            s.add(q)
        assert sorted(decode(s)) == ["a", "b", "c"]  # 6 of 7 blocks
        decode(s)  # each needs a 3rd block: one is free, so one of them is preempted
        assert s.num_preemptions == 1, policy
        (gone,) = [q for q in seqs if q.kv.num_computed == 0]
        assert gone.request_id == victim and gone in s.waiting and not gone.kv.block_table, (policy, priorities)
        assert gone.output_ids == [7]  # its tokens are kept: it is recomputed, prompt and output
        late = seq("d", 4, 900)
        late.sched.priority = priorities[0]
        s.add(late)  # FCFS: the victim waits first; priority: by (priority, arrival)
        expected = ["d", gone.request_id] if policy == "priority" and gone.sched.priority > late.sched.priority \
            else [gone.request_id, "d"]
        assert [q.request_id for q in s.waiting] == expected, policy


def test_priority_admits_lower_values_first_and_arrival_among_equals():
    s = make(64, "priority", max_tokens=8)
    for name, p in [("late-low", 3), ("high", -1), ("mid-1", 1), ("mid-2", 1)]:
        q = seq(name, 8, 10 * len(s.waiting))
        q.sched.priority = p
        s.add(q)
    assert [q.request_id for q in s.waiting] == ["high", "mid-1", "mid-2", "late-low"]
    assert decode(s) == ["high"]  # the budget of 8 holds one prompt a step
    assert decode(s) == ["high", "mid-1"]  # high's decode, then 7 tokens of mid-1's prompt
    assert [q.request_id for q in s.waiting] == ["mid-2", "late-low"]
    fcfs = make(64, "fcfs", max_tokens=8)
    for name in ["late-low", "high"]:
        fcfs.add(seq(name, 8))
    assert [q.request_id for q in fcfs.waiting] == ["late-low", "high"]


def test_prefix_hits_are_taken_and_given_back_when_the_prompt_cannot_start():
    s = make(8)
    a = seq("a", 12)
    s.add(a)
    decode(s)
    s.finish(a)  # its 3 full blocks stay cached
    b = seq("b", 14)  # same first 12 tokens, then 2 more
    s.add(b)
    assert decode(s) == ["b"]
    assert s.blocks.stats.prefix_hits == 12 and b.kv.num_computed == 14
    # now a prompt whose cached prefix is found but whose rest cannot be placed: the hits are given back
    s2 = make(4)
    filler, x = seq("f", 3, 500), seq("x", 8)
    s2.add(filler)
    s2.add(x)
    assert decode(s2) == ["f", "x"]
    s2.finish(x)  # its 2 blocks free, still named
    y = seq("y", 24)  # x's 8 tokens then 16 more: 2 hits, and 4 blocks for the rest with 1 free
    s2.add(y)
    assert decode(s2) == ["f"]
    assert not y.kv.block_table and y.kv.num_computed == 0 and y in s2.waiting  # hits given back, retried later
    assert s2.blocks.num_used == 1 and s2.blocks.stats.prefix_hits == 8
    s2.finish(filler)
    assert decode(s2) == ["y"]  # alone: its hits again, and as much of the rest as the pool holds
    assert s2.blocks.stats.prefix_hits == 16 and y.kv.num_computed == 16 and len(y.kv.block_table) == 4


def test_forks_share_blocks_and_copy_the_partial_block_on_write():
    s = make(16)
    parent = seq("p", 6)  # 2 blocks: one full, one half full
    child = seq("p", 6)
    child.index = 1
    parent.forks = [child]
    s.add(parent)
    decode(s)
    s.fork(parent, child)
    parent.forks = []
    assert child.kv.block_table == parent.kv.block_table and s.blocks.groups[0].is_shared(parent.kv.block_table[1])
    batch = s.schedule()  # both write token 7 into the shared half-full block: each gets its own copy
    assert len(batch.block_copies[0]) == 1  # the first writer copies; the last one left owns the original
    assert parent.kv.block_table[0] == child.kv.block_table[0] and parent.kv.block_table[1] != child.kv.block_table[1]
    assert s.blocks.groups[0].is_shared(parent.kv.block_table[0])


def test_speculative_tokens_are_trimmed_to_the_budget_and_dropped_on_preemption():
    s = make(16, max_tokens=4)
    a = seq("a", 4)
    s.add(a)
    decode(s)
    a.spec.tokens = [5, 6, 7, 8, 9]  # 1 + 5 tokens asked, a budget of 4
    batch = s.schedule()
    assert batch.num_tokens == [4] and a.spec.tokens == [5, 6, 7]
    s.update_after_forward(batch)
    assert a.kv.num_computed == 5  # the guesses count once accepted, not before
    a.spec.tokens = [1, 2]
    s.preempt(a)
    assert a.spec.tokens == [] and a.kv.num_computed == 0 and a in s.waiting


def test_allocate_slots_is_all_or_nothing():
    from nanoinfer.engine.kv_manager import BlockManager
    m = BlockManager(3, 4)
    table: list[int] = []
    assert m.allocate_slots(table, 0, 8) == table and len(table) == 2
    assert m.allocate_slots(table, 8, 9) is None and len(table) == 2 and m.num_free == 1  # 5 blocks asked
    forked = m.fork(table)
    assert m.allocate_slots(forked, 6, 1) is not None  # copy-on-write of the shared second block
    assert forked[1] != table[1] and m.take_pending_copies() == [(table[1], forked[1])]
    assert m.allocate_slots(forked, 7, 4) is None  # a third block: none left


def test_priority_through_the_engine(llama_dir):
    """One seat: the lowest priority value is served first, then arrival order among equals;
    under FCFS the same requests run in arrival order."""
    from nanoinfer import LLM

    order = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(llama_dir, max_num_seqs=1, scheduling_policy=policy)
        for rid, rank in [("a", 2), ("b", 0), ("c", 2), ("d", -1)]:
            llm.engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0), priority=rank)
        firsts = []
        while llm.engine.has_unfinished():
            firsts += [d.request_id for d in llm.engine.step() if d.request_id not in firsts]
        order[policy] = firsts
    assert order == {"fcfs": ["a", "b", "c", "d"], "priority": ["d", "b", "a", "c"]}
    outs = LLM(llama_dir, scheduling_policy="priority").generate(["x y", "z"], SamplingParams(max_tokens=3, ignore_eos=True),
                                                                priority=[1, 0])
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_the_server_passes_priority_to_the_engine(llama_dir):
    """`priority` in a completions or chat body (vLLM's field) reaches the engine's add_request."""
    import openai

    from nanoinfer import LLM
    from nanoinfer.server import ServerConfig, create_app

    from server_utils import serve_in_thread

    llm = LLM(llama_dir, scheduling_policy="priority")
    seen = []
    add = llm.engine.add_request

    def recording(request_id, prompt_ids, params, prompt=None, priority=0):
        seen.append(priority)
        return add(request_id, prompt_ids, params, prompt, priority)

    llm.engine.add_request = recording
    with serve_in_thread(create_app(llm.engine, ServerConfig(model_name="m"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        client.completions.create(model="m", prompt="a b", max_tokens=2, extra_body={"priority": -3})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": 7}, stream=False)
        list(client.completions.create(model="m", prompt="c", max_tokens=2, stream=True))
    assert seen == [-3, 7, 0]


def test_decodes_go_first_and_the_pacer_sizes_prefill_chunks_beside_them():
    """Prompt chunks beside decodes take what the step-time target leaves; alone, the whole budget."""
    s = Scheduler(SchedulerConfig(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                  step_time_target_s=0.02))
    a = seq("a", 40)
    s.add(a)
    assert run(s) == ["a"] and a.kv.num_computed == 40  # no estimate yet: the token budget alone
    s.pacer.observe(40, 0.040)  # 1 ms a token: a 20 ms step holds 20 tokens
    a.output_ids.append(7)  # a sampled token: a decodes from now on
    b = seq("b", 100, first_token=200)
    s.add(b)
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["a", "b"] and batch.num_tokens == [1, 19]
    s.update_after_forward(batch)
    # b, still prefilling and admitted before c, comes after a's decode
    c = seq("c", 8, first_token=400)
    s.add(c)
    a.output_ids.append(8)
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["a", "b"] and batch.num_tokens == [1, 19]
    s.update_after_forward(batch)
    s.finish(a)  # nothing decodes: prefill takes the whole budget
    batch = s.schedule()
    assert [q.request_id for q in batch.seqs] == ["b", "c"] and batch.num_tokens == [62, 2]


def test_a_prompt_never_starves_and_small_steps_do_not_teach_the_pacer():
    s = Scheduler(SchedulerConfig(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                  step_time_target_s=0.001))
    s.pacer.observe(8, 10.0)  # too few tokens to measure per-token cost: ignored
    assert s.pacer.seconds_per_token is None
    s.pacer.observe(64, 0.064)  # 1 ms a token: the target holds one token, less than a decode's share
    a, b = seq("a", 4), seq("b", 50, first_token=100)
    s.add(a)
    run(s)
    a.output_ids.append(5)
    s.add(b)
    batch = s.schedule()
    assert batch.num_tokens == [1, s.pacer.min_chunk]  # the minimum chunk still advances
