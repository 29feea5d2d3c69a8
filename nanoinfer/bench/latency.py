"""`bench latency`: one prefill and a decode run per batch size, against the roofline.

For each batch size B, B random prompts of P tokens are submitted at once with a token
budget that prefills them all in one step; that step is the TTFT. Then every decode
step is timed: TPOT is the median step (robust to a stray slow step on a shared
machine), decode tok/s is B / TPOT. MBU and MFU compare the step with what the
hardware could do at the middle of the decode (context P + D/2). The batch sizes run one
after another, or with `--interleave` side by side: all prefilled, then one decode step of
each in turn, for ratios between them that a drifting machine cannot skew. `--cold-cache` reads
a tensor far larger than the last-level cache before each timed step, so that the weights come
from memory even where the model would fit the cache.

`--compare llama.cpp` then measures batch 1 against llama.cpp on the same GGUF file, same
prompt ids, decode length and threads, for `--runs` rounds that alternate which engine goes
first; llama.cpp runs in a subprocess of its own interpreter (see llama_cpp.py). Several
prompt lengths (`--prompt-len 512,2048`) and files (`--also FILE`, repeatable) are compared
one after another in the same way, and a table of every file's ratios ends the run.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import EngineConfig, LLMEngine
from ..errors import NanoinferError
from ..sampling import SamplingParams
from .common import (
    BLOCK_SIZE,
    BenchEnv,
    emit_json,
    fmt_bytes,
    fmt_pct,
    fmt_si,
    kv_pool_bytes,
    median,
    on_gpu,
    parse_counts,
    peak_memory_bytes,
    plot_path,
    print_table,
    progress,
    progress_done,
    random_prompt,
    reset_peak_memory,
    run_meta,
    setup,
    sync,
)
from .llama_cpp import ENGINE, check_python, resolve_python, run_llama_cpp
from .peaks import cpu_model, cpu_probe_bytes, last_level_cache_bytes


def print_card(env: BenchEnv, card: dict) -> None:
    p, w = env.peaks, card["weight_bytes_detail"]
    lookups = (f"{fmt_bytes(w['embedding'])} of lookup tables, {fmt_bytes(w['lookup_bytes_per_token'])} read per token"
               if w["embedding"] else "")
    tied = "; ".join(x for x in ("token table tied: read whole as the LM head" if w["tied"] else "", lookups) if x)
    cb = card["compute_bound_batch"]
    print(f"model      {env.loaded.path.name} ({env.loaded.format}, {env.loaded.config.architecture}), "
          f"{env.dtype} on {env.device}, {torch.get_num_threads()} threads")
    print(f"peaks      {fmt_si(p.flops, 'FLOP/s')} ({p.compute}), {fmt_si(p.bandwidth, 'B/s')} "
          f"({p.source}: {p.device_name})")
    print(f"weights    {fmt_bytes(card['weight_bytes'])} as served ({tied})")
    print(f"KV cache   {fmt_bytes(card['kv_bytes_per_token'])}/token; a decode step at context {card['context']} "
          f"reads {fmt_bytes(card['kv_bytes_read_per_seq'])}/sequence")
    print(f"decode     {fmt_si(card['decode_flops_per_token'], 'FLOP')}/token, "
          f"{fmt_bytes(card['decode_bytes_batch1'])}/step at batch 1")
    print(f"ceiling    {card['batch1_ceiling_tok_s']:.1f} tok/s at batch 1 (bandwidth-bound); compute-bound from batch "
          f"{'never (KV traffic grows as fast as compute)' if cb is None else f'{cb:.0f}'}")
    print("bytes      weights as served + embedding rows touched + KV within windows "
          "(nanochat counts whole tables and fp32 weights)")
    print()


def batch_prompts(env: BenchEnv, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The random prompts of a batch size: the same ids for every run with the same seed."""
    rng = random.Random(seed + batch)
    return [random_prompt(rng, prompt_len, env.loaded.config.vocab_size) for _ in range(batch)]


@dataclass
class ColdCache:
    """`--cold-cache`: a tensor far larger than the last-level cache (the bandwidth probe's size),
    read before each timed step, so that every step finds the weights in memory and not in a
    cache, as on a CPU whose last-level cache is much smaller than the model. Where the model fits
    the cache (SmolLM2-135M's 96 MB in a Xeon's 300 MiB L3) batch 1 streams it from there, far
    faster than from memory, while larger batches are bound by their arithmetic. Not timed."""
    buf: torch.Tensor

    @classmethod
    def for_this_cpu(cls) -> ColdCache:
        return cls(torch.ones(cpu_probe_bytes(last_level_cache_bytes()) // 4))

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    def evict(self) -> None:
        self.buf.sum()


@dataclass
class BatchRun:
    """One batch size's engine, once its prompts are prefilled, and its decode steps' times."""
    batch: int
    engine: LLMEngine
    ttft: float
    steps: list[float] = field(default_factory=list)
    cold: ColdCache | None = None


def start_batch(env: BenchEnv, batch: int, prompt_len: int, decode_len: int, seed: int,
                cold: ColdCache | None = None) -> BatchRun:
    """`batch` prompts prefilled in one step (its time: the TTFT)."""
    rl = env.roofline
    total = prompt_len + decode_len
    engine = LLMEngine(env.loaded, EngineConfig(
        max_model_len=total, kv_cache_memory=kv_pool_bytes(rl, [total] * batch, BLOCK_SIZE),
        block_size=BLOCK_SIZE, max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
        attention_backend=env.args.attention_backend, kv_cache_dtype=env.args.kv_cache_dtype))
    params = SamplingParams(temperature=0.0, max_tokens=decode_len, ignore_eos=True)
    for i, prompt in enumerate(batch_prompts(env, batch, prompt_len, seed)):
        engine.add_request(str(i), prompt, params)
    progress(f"batch {batch}: prefill {batch} x {prompt_len} tokens ...")
    if cold:
        cold.evict()
    sync(env.device)
    t0 = time.perf_counter()
    engine.step()
    sync(env.device)
    ttft = time.perf_counter() - t0
    if engine.last_step_tokens != batch * prompt_len:
        raise NanoinferError(f"batch {batch}: the prefill took more than one step (KV pool or budget too small)")
    return BatchRun(batch, engine, ttft, cold=cold)


def decode_step(env: BenchEnv, run: BatchRun, decode_len: int) -> None:
    if run.cold:
        run.cold.evict()
    t0 = time.perf_counter()
    run.engine.step()
    sync(env.device)
    run.steps.append(time.perf_counter() - t0)
    progress(f"batch {run.batch}: decode step {len(run.steps)}/{decode_len - 1}", throttle=True)


def run_batch(env: BenchEnv, batch: int, prompt_len: int, decode_len: int, seed: int,
              cold: ColdCache | None = None) -> dict:
    """Prefill `batch` prompts in one step, then decode to the end; times in seconds."""
    reset_peak_memory(env.device)
    run = start_batch(env, batch, prompt_len, decode_len, seed, cold)
    while run.engine.has_unfinished():
        decode_step(env, run, decode_len)
    progress_done()
    return batch_result(env, run, prompt_len, decode_len, peak_memory_bytes(env.device))


def run_interleaved(env: BenchEnv, batches: list[int], prompt_len: int, decode_len: int, seed: int,
                    cold: ColdCache | None = None) -> list[dict]:
    """Every batch size prefilled, then one decode step of each in turn (the order reversed each
    round), so that every TPOT is timed over the same stretch: on a machine whose speed drifts
    (a shared host's memory, say) the ratios between batch sizes hold, where runs one after
    another compare different moments. But each step then follows another batch size's, whose
    weights and KV rows have passed through the caches: where the weights come near the
    last-level cache, every step runs slower than alone (SmolLM2-135M's 96 MB against a 32 MiB
    L3: batch 1 at 6.7-7.2 ms a step, 4.8-5.6 alone), so it is for ratios on models well past
    the cache. Peak memory is then the whole run's."""
    reset_peak_memory(env.device)
    runs = [start_batch(env, b, prompt_len, decode_len, seed, cold) for b in batches]
    round_ = 0
    while any(r.engine.has_unfinished() for r in runs):
        for run in runs if round_ % 2 == 0 else runs[::-1]:
            if run.engine.has_unfinished():
                decode_step(env, run, decode_len)
        round_ += 1
    progress_done()
    memory = peak_memory_bytes(env.device)
    return [batch_result(env, r, prompt_len, decode_len, memory) for r in runs]


def batch_result(env: BenchEnv, run: BatchRun, prompt_len: int, decode_len: int, memory: int) -> dict:
    """A finished run's figures against the roofline (its engine is let go)."""
    batch, ttft, steps = run.batch, run.ttft, run.steps
    generated = [len(run.engine.release(str(i)).outputs[0].token_ids) for i in range(batch)]
    run.engine = None
    gc.collect()

    rl = env.roofline
    mid = prompt_len + decode_len // 2
    tpot = median(steps)
    prefill_flops = rl.prefill_flops(batch, prompt_len)
    step_bytes = rl.decode_step_bytes(batch, mid)
    step_flops = rl.decode_step_flops(batch, mid)
    p = env.peaks
    return {
        "batch_size": batch,
        "prompt_len": prompt_len,
        "decode_len": decode_len,
        "generated_tokens": sum(generated),
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "prefill_flops": prefill_flops,
        "prefill_bytes": rl.prefill_bytes(batch, prompt_len),
        "prefill_mfu": prefill_flops / ttft / p.flops,
        "decode_steps": len(steps),
        "tpot_s": tpot,
        "tpot_mean_s": sum(steps) / len(steps),
        "decode_tok_s": batch / tpot,
        "decode_tok_s_mean": batch * len(steps) / sum(steps),  # B x steps / time, as nanochat's tok/s
        "decode_context": mid,
        "decode_step_bytes": step_bytes,
        "decode_step_flops": step_flops,
        "mbu": step_bytes / tpot / p.bandwidth,
        "mfu": step_flops / tpot / p.flops,
        "peak_memory_bytes": memory,
        "peak_memory_kind": "cuda_max_allocated" if env.device.type == "cuda" else "rss_high_water",
    }


def warm_up(env: BenchEnv) -> None:
    """First calls pay for allocator growth, lazy init and kernel selection: not latency."""
    rl = env.roofline
    engine = LLMEngine(env.loaded, EngineConfig(max_model_len=40, kv_cache_memory=kv_pool_bytes(rl, [40, 40], BLOCK_SIZE),
                                                block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                                                attention_backend=env.args.attention_backend,
                                                kv_cache_dtype=env.args.kv_cache_dtype))
    rng = random.Random(0)
    for i in range(2):
        engine.add_request(str(i), random_prompt(rng, 32, env.loaded.config.vocab_size),
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync(env.device)


COMPARED = ("prefill_tok_s", "decode_tok_s", "decode_tok_s_mean", "ttft_s", "tpot_s")


def _ratios(ours: dict, theirs: dict) -> dict:
    return {"prefill": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
            "decode": ours["decode_tok_s"] / theirs["decode_tok_s"]}


def compare_llama_cpp(env: BenchEnv, python: str, version: str, prompt_len: int, decode_len: int, runs: int,
                      seed: int) -> dict:
    """Batch 1, ours and llama.cpp in turn for `runs` rounds (the first engine alternates),
    on the same prompt ids; per-run figures, their medians and the ratios ours / llama.cpp."""
    prompt = batch_prompts(env, 1, prompt_len, seed)[0]
    threads = torch.get_num_threads()
    rows = []
    for i in range(runs):
        order = ["nanoinfer", "llama_cpp"] if i % 2 == 0 else ["llama_cpp", "nanoinfer"]
        row: dict = {"run": i + 1, "order": order}
        for who in order:
            progress(f"compare run {i + 1}/{runs}: {'nanoinfer' if who == 'nanoinfer' else ENGINE} ...")
            if who == "nanoinfer":
                r = run_batch(env, 1, prompt_len, decode_len, seed)
                row[who] = {k: r[k] for k in COMPARED}
            else:
                row[who] = run_llama_cpp(python, str(env.loaded.path), prompt, decode_len, threads)
        row["ratio"] = _ratios(row["nanoinfer"], row["llama_cpp"])
        rows.append(row)
    progress_done()
    med = {who: {k: median([r[who][k] for r in rows]) for k in COMPARED} for who in ("nanoinfer", "llama_cpp")}
    return {"engine": ENGINE, "version": version, "python": python, "model": str(env.loaded.path),
            "cpu": cpu_model(), "threads": threads, "batch_size": 1, "prompt_len": prompt_len,
            "decode_len": decode_len, "nanoinfer_dtype": env.dtype, "runs": rows, "median": med,
            "ratio": _ratios(med["nanoinfer"], med["llama_cpp"])}


def print_compare(c: dict) -> None:
    print()
    print(f"batch 1 against {c['engine']} {c['version']} on {c['cpu']}, {c['threads']} threads: same GGUF file, "
          f"same prompt ids ({c['prompt_len']} tokens), {c['decode_len']} greedy tokens")
    print(f"(nanoinfer in {c['nanoinfer_dtype']}, {c['engine']} runs the file as stored; decode tok/s = 1 / median "
          f"step; ratio = nanoinfer / {c['engine']})")

    def cells(label: str, first: str, ours: dict, theirs: dict, ratio: dict) -> list[str]:
        return [label, first, f"{ours['prefill_tok_s']:.1f}", f"{theirs['prefill_tok_s']:.1f}",
                f"{ratio['prefill']:.2f}x", f"{ours['decode_tok_s']:.1f}", f"{theirs['decode_tok_s']:.1f}",
                f"{ratio['decode']:.2f}x"]

    rows = [cells(str(r["run"]), "nanoinfer" if r["order"][0] == "nanoinfer" else c["engine"], r["nanoinfer"],
                  r["llama_cpp"], r["ratio"]) for r in c["runs"]]
    rows.append(cells("median", "", c["median"]["nanoinfer"], c["median"]["llama_cpp"], c["ratio"]))
    print_table(["run", "first", "prefill nanoinfer", f"prefill {c['engine']}", "ratio", "decode nanoinfer",
                 f"decode {c['engine']}", "ratio"], rows)


def parse_prompt_lens(text: str | int | None) -> list[int | None]:
    """--prompt-len: one length, or with --compare several (comma-separated); [None]: the default."""
    if text is None:
        return [None]
    try:
        lens = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise NanoinferError(f"--prompt-len {text!r}: a number of tokens, or a comma-separated list with --compare") \
            from None
    if any(n < 1 for n in lens):
        raise NanoinferError("--prompt-len must be >= 1")
    return lens


def print_compare_summary(comparisons: list[dict]) -> None:
    print()
    print(f"every file against {comparisons[0]['engine']} (medians of {len(comparisons[0]['runs'])} alternating runs; "
          f"ratio = nanoinfer / {comparisons[0]['engine']})")
    print_table(["file", "prompt", "prefill nanoinfer", "prefill ratio", "decode nanoinfer", "decode ratio"],
                [[Path(c["model"]).name, str(c["prompt_len"]), f"{c['median']['nanoinfer']['prefill_tok_s']:.1f}",
                  f"{c['ratio']['prefill']:.2f}x", f"{c['median']['nanoinfer']['decode_tok_s']:.1f}",
                  f"{c['ratio']['decode']:.2f}x"] for c in comparisons])


def compare_files(env: BenchEnv, args: argparse.Namespace, python: str, version: str, prompt_lens: list[int | None],
                  decode_len: int, runs: int) -> list[dict]:
    """--compare on --model's file (already loaded as env), then on each --also file, at each
    prompt length."""
    comparisons = []
    for i, model in enumerate([args.model, *(args.also or [])]):
        if i:
            env = setup(argparse.Namespace(**{**vars(args), "model": model}))
            check_gguf(env)
            warm_up(env)
        max_len = env.loaded.config.max_position_embeddings
        for n in prompt_lens:
            comparison = compare_llama_cpp(env, python, version, min(n or 128, max_len - decode_len), decode_len, runs,
                                           args.seed)
            print_compare(comparison)
            comparisons.append(comparison)
    if len(comparisons) > 1:
        print_compare_summary(comparisons)
    return comparisons


def check_gguf(env: BenchEnv) -> None:
    if env.loaded.format != "gguf":
        raise NanoinferError(f"--compare llama.cpp needs a GGUF model (llama.cpp runs the same file): "
                             f"{env.loaded.path} is {env.loaded.format}")


def run(args: argparse.Namespace) -> int:
    gpu = on_gpu(args)
    compare = getattr(args, "compare", None)
    default_sizes = "1" if compare else "1,8,32,128" if gpu else "1,8,32"
    batch_sizes = parse_counts(args.batch_sizes or default_sizes, "--batch-sizes", "1,8,32")
    decode_len = args.decode_len or (256 if gpu else 64)
    prompt_lens = parse_prompt_lens(args.prompt_len)
    if len(prompt_lens) > 1 and not compare:
        raise NanoinferError("several --prompt-len values go with --compare; give one")
    if getattr(args, "also", None) and not compare:
        raise NanoinferError("--also adds a file to --compare llama.cpp")
    if decode_len < 2:
        raise NanoinferError("--decode-len must be >= 2 (the first token comes from the prefill)")
    if getattr(args, "speculative", None) and compare:
        raise NanoinferError("--speculative and --compare are separate runs: give one")
    interleave = getattr(args, "interleave", False)
    if interleave and (len(batch_sizes) < 2 or getattr(args, "speculative", None)):
        raise NanoinferError("--interleave takes turns between several --batch-sizes: give two or more "
                             "(and no --speculative)")
    cold_cache = getattr(args, "cold_cache", False)
    if cold_cache and (gpu or compare or getattr(args, "speculative", None)):
        raise NanoinferError("--cold-cache goes with the CPU's batch sweep (no --compare, --speculative or GPU)")
    plot = plot_path(args)
    runs = getattr(args, "runs", 3)
    if compare:
        if gpu:
            raise NanoinferError("--compare llama.cpp measures the CPU: add --device cpu")
        if runs < 1:
            raise NanoinferError("--runs must be >= 1")
        python = resolve_python(args.llama_cpp_python)
        version = check_python(python)
    env = setup(args)
    if compare:
        check_gguf(env)
    max_len = env.loaded.config.max_position_embeddings
    if decode_len >= max_len:
        raise NanoinferError(f"--decode-len {decode_len} leaves no room for a prompt in the context of {max_len}")
    # As nanochat's bench: the prompt is clamped so that prompt + decode fits the context.
    prompt_len = min(prompt_lens[0] or (2048 if gpu else 128), max_len - decode_len)
    mid = prompt_len + decode_len // 2
    card = env.roofline.card(mid, env.peaks.flops, env.peaks.bandwidth)
    print_card(env, card)

    if getattr(args, "speculative", None):
        from .speculative import print_speculative, run_speculative
        res = run_speculative(env, args, decode_len)
        print_speculative(res)
        emit_json({**run_meta(env, "latency"), "speculative": res})
        return 0
    if getattr(args, "speculative_config", None) is not None:
        raise NanoinferError("--speculative-config on bench latency goes with --speculative METHOD")
    warm_up(env)
    cold = ColdCache.for_this_cpu() if cold_cache else None
    if interleave:
        results = run_interleaved(env, batch_sizes, prompt_len, decode_len, args.seed, cold)
    else:
        results = [run_batch(env, b, prompt_len, decode_len, args.seed, cold) for b in batch_sizes]
    print(f"prompt {prompt_len} tokens, decode {decode_len} tokens; TPOT = median decode step; "
          f"MBU/MFU at context {mid}")
    if cold:
        print(f"cold cache: {fmt_bytes(cold.nbytes)} read before each timed step (untimed), so the "
              f"weights come from memory, not the {fmt_bytes(last_level_cache_bytes())} last-level cache")
    rows = [[str(r["batch_size"]), f"{r['ttft_s'] * 1e3:.1f}", f"{r['prefill_tok_s']:.1f}", fmt_pct(r["prefill_mfu"]),
             f"{r['tpot_s'] * 1e3:.2f}", f"{r['decode_tok_s']:.1f}", fmt_pct(r["mbu"]), fmt_pct(r["mfu"]),
             fmt_bytes(r["peak_memory_bytes"])] for r in results]
    print_table(["batch", "TTFT ms", "prefill tok/s", "prefill MFU", "TPOT ms", "decode tok/s", "MBU", "MFU",
                 "peak mem"], rows)
    if env.device.type == "cpu":
        print("(peak mem: the process's RSS high-water mark so far, model included)")
    if interleave:
        first = results[0]
        print(f"decode steps taken in turn; TPOT against batch {first['batch_size']}: "
              + ", ".join(f"batch {r['batch_size']} {r['tpot_s'] / first['tpot_s']:.2f}x" for r in results[1:]))
    comparisons = compare_files(env, args, python, version, prompt_lens, decode_len, runs) if compare else []
    if plot:
        from .plots import plot_roofline
        plot_roofline(plot, env.peaks.flops, env.peaks.bandwidth, results,
                      title=f"{env.loaded.path.name}, {env.dtype}, {env.peaks.device_name}")
        print(f"roofline plot: {plot}")
    doc = {**run_meta(env, "latency"), "card": card, "results": results, "plot": plot,
           "interleaved": bool(interleave), "cold_cache_bytes": cold.nbytes if cold else 0}
    if comparisons:
        doc["compare"] = comparisons[0]
    if len(comparisons) > 1:
        doc["compares"] = comparisons
    emit_json(doc)
    return 0
