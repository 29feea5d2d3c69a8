"""`bench verify`: what a forward costs by its rows of one sequence.

Speculation checks k guesses in one forward of 1 + k rows of one sequence, and whether that
pays depends on what those rows cost against one (spec_decode.policy measures it as the engine
runs). Here one random prompt is prefilled, then forwards of R rows at the position after it
(the sequence's next token and R - 1 made-up guesses; nothing is accepted, so each forward writes
the same cache slots again) go through the model runner, each R in turn and the order reversed
each round, so that every row count sees the same stretch of the machine; the median per R, and
each against the first. Rows of one sequence attend over one cache: the figure is speculation's,
not a batch's (`bench latency --batch-sizes 1,4 --interleave` has several sequences)."""
from __future__ import annotations

import argparse
import random
import time

import torch

from ..engine import EngineConfig, LLMEngine
from ..engine.batch import ScheduledBatch
from ..errors import NanoinferError
from ..sampling import SamplingParams
from .common import (
    BLOCK_SIZE,
    emit_json,
    kv_pool_bytes,
    median,
    parse_counts,
    print_table,
    progress,
    progress_done,
    random_prompt,
    run_meta,
    setup,
    sync,
)


def run(a: argparse.Namespace) -> int:
    rows = list(dict.fromkeys(parse_counts(a.rows, "--rows", "1,4,5,8")))  # each row count once, in order
    if a.prompt_len < 1:
        raise NanoinferError("--prompt-len must be >= 1")
    if a.rounds < 1:
        raise NanoinferError("--rounds must be >= 1")
    env = setup(a, need_peaks=False)
    config = env.loaded.config
    if a.prompt_len + max(rows) > config.max_position_embeddings:
        raise NanoinferError(f"--prompt-len {a.prompt_len} plus {max(rows)} rows passes the model's context "
                             f"({config.max_position_embeddings})")
    length = a.prompt_len + max(rows)
    engine = LLMEngine(env.loaded, EngineConfig(max_model_len=length + 1, max_num_seqs=1,
                                                max_num_batched_tokens=a.prompt_len, block_size=BLOCK_SIZE,
                                                kv_cache_memory=kv_pool_bytes(env.roofline, [length], BLOCK_SIZE)))
    rng = random.Random(a.seed)
    engine.add_request("verify", random_prompt(rng, a.prompt_len, config.vocab_size),
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    progress(f"prefilling {a.prompt_len} tokens ...")
    seq = None
    while seq is None or seq.kv.num_computed < a.prompt_len:  # then it has sampled its next token
        engine.step()
        seq = engine.scheduler.running[0]
    if not engine.scheduler.blocks.allocate_slots(seq.kv, max(rows)):
        raise NanoinferError("bench verify: the KV pool has no room for the rows")
    guesses = random_prompt(rng, max(rows) - 1, config.vocab_size)
    no_copies = [[] for _ in engine.cache.groups]
    times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(a.rounds):
        progress(f"round {i + 1}/{a.rounds}", throttle=True)
        for r in rows if i % 2 == 0 else rows[::-1]:
            seq.spec.tokens = guesses[:r - 1]
            t0 = time.perf_counter()
            engine.runner.run(ScheduledBatch([seq], [r], no_copies))
            sync(env.device)
            times[r].append(time.perf_counter() - t0)
    seq.spec.tokens = []
    progress_done()
    base = median(times[rows[0]])
    results = [{"rows": r, "seconds": median(times[r]), "seconds_all": times[r], "vs_first": median(times[r]) / base}
               for r in rows]
    print(f"bench verify: {a.model or 'the default model'}, one sequence at position {a.prompt_len}, "
          f"{torch.get_num_threads()} threads, median of {a.rounds} rounds")
    print_table(["rows", "forward ms", f"vs {rows[0]} row(s)"],
                [[str(x["rows"]), f"{x['seconds'] * 1e3:.2f}", f"{x['vs_first']:.2f}x"] for x in results])
    emit_json({**run_meta(env, "verify"), "prompt_len": a.prompt_len, "rounds": a.rounds, "results": results})
    return 0
