"""`bench throughput`: many requests at once, run to completion (nano-vllm's protocol).

N requests of random token prompts, input and output lengths drawn uniformly from
[min, max] with a seed, ignore_eos so each produces exactly its requested tokens, all
submitted at once. Figures: output tok/s (requested output tokens / wall time), total
tok/s (prompt + output tokens / wall time), requests/s.

`--structured json` runs them a second time with every request under a JSON schema
(BENCH_SCHEMA: an array of at least 64 records, so that every output runs to its length), and reports
both runs, their ratio and the time the grammar masks took per step; `--rounds N` alternates
the two N times and compares medians.

`--compare transformers` runs the same requests through `model.generate` in static,
left-padded batches (greedy, nothing stops early): how a plain transformers script
serves a batch. Only each request's requested output tokens count as useful output;
the padding and the tokens generated past a request's length are the static batch's waste.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import time
from dataclasses import dataclass

import torch

from ..engine import EngineConfig, LLMEngine
from ..errors import NanoinferError
from ..sampling import SamplingParams, StructuredOutputsParams
from .common import (
    BLOCK_SIZE,
    BenchEnv,
    emit_json,
    fmt_bytes,
    kv_pool_bytes,
    median,
    on_gpu,
    percentile,
    plot_path,
    print_table,
    progress,
    progress_done,
    random_prompt,
    run_meta,
    setup,
    sync,
)

# At least 64 records: no output can close its JSON before its length (128 tokens at most by default).
BENCH_SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "score", "tags"]}}


@dataclass
class Request:
    prompt_ids: list[int]
    output_len: int


def make_requests(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = random_prompt(rng, rng.randint(*input_range), vocab_size)
        reqs.append(Request(prompt, rng.randint(*output_range)))
    return reqs


def figures(reqs: list[Request], output_tokens: int, seconds: float) -> dict:
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (prompt_tokens + output_tokens) / seconds,
        "requests_per_s": len(reqs) / seconds,
    }


def pool_limit(device: torch.device) -> int:
    """Most of the memory still free: the pool is sized for all requests at once, which a
    big run on a small machine may not afford (the engine then preempts, and says so)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def run_engine(env: BenchEnv, reqs: list[Request], max_num_seqs: int, max_num_batched_tokens: int,
               structured: StructuredOutputsParams | None = None) -> dict:
    lens = [len(r.prompt_ids) + r.output_len for r in reqs]
    pool = min(kv_pool_bytes(env.roofline, lens, BLOCK_SIZE), pool_limit(env.device))
    engine = LLMEngine(env.loaded, EngineConfig(
        max_model_len=max(lens), kv_cache_memory=pool, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, speculative_config=env.args.speculative_config,
        attention_backend=env.args.attention_backend, scheduling_policy=env.args.scheduling_policy,
        step_time_target_ms=env.args.step_time_target_ms))
    # Warm up on a throwaway request (first calls pay for lazy initialisation), with its
    # own random prompt so that it leaves nothing in the prefix cache for the others.
    warmup = random_prompt(random.Random(-1), max(1, min(16, max(lens) - 2)), env.loaded.config.vocab_size)
    engine.add_request("warmup", warmup, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.release("warmup")
    steps0 = engine.total_steps
    if structured is not None:  # compiled before the clock starts, as the server compiles before submitting
        engine.structured.compile(structured)

    want = sum(r.output_len for r in reqs)
    sync(env.device)
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(str(i), r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                                                                structured_outputs=structured),
                           priority=i % env.args.priority_levels)
    done = 0
    while engine.has_unfinished():
        deltas = engine.step()
        done += sum(len(d.token_ids) for d in deltas)
        m = engine.scheduler
        progress(f"nanoinfer: {done}/{want} output tokens, {len(m.running)} running, {len(m.waiting)} waiting",
                 throttle=True)
    sync(env.device)
    seconds = time.perf_counter() - t0
    progress_done()
    outs = [engine.release(str(i)) for i in range(len(reqs))]
    metrics = engine.metrics()
    mask_seconds = engine.structured.mask_seconds
    del engine
    gc.collect()
    produced = [len(o.outputs[0].token_ids) for o in outs]
    short = sum(1 for o, r in zip(produced, reqs) if o != r.output_len)
    if short and structured is None:
        raise NanoinferError(f"{short} requests did not produce their requested tokens (context too small?)")
    ttfts = [o.stats[0].ttft for o in outs]
    res = figures(reqs, sum(produced), seconds)
    levels = env.args.priority_levels
    if levels > 1:  # request i has priority i % levels: the median TTFT of each
        res["ttft_median_s_by_priority"] = {p: median(ttfts[p::levels]) for p in range(levels)}
    res.update({
        "ttft_median_s": median(ttfts),
        "ttft_p90_s": percentile(ttfts, 90),
        "steps": metrics["steps"] - steps0,
        "preemptions": metrics["preemptions"],
        "kv_cache_bytes": pool,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
    })
    if env.args.speculative_config is not None:
        res.update({k: v for k, v in metrics.items() if k.startswith("spec_")})
    if structured is not None:
        steps = res["steps"]
        res.update({"structured": structured.kind, "closed_early": short,
                    "mask_ms_per_step": 1000 * mask_seconds / steps if steps else 0.0})
    return res


def load_transformers(env: BenchEnv):
    """The same model file through transformers, in the same dtype, on the same device."""
    import transformers
    from transformers import AutoModelForCausalLM

    from ..llm import DTYPES

    transformers.logging.set_verbosity_error()
    path, dtype = env.loaded.path, DTYPES[env.dtype] or torch.float32
    progress(f"loading {path.name} with transformers ...")
    if env.loaded.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    elif env.loaded.format == "hf":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        raise NanoinferError(f"--compare transformers: transformers cannot load a {env.loaded.format} model")
    progress_done()
    return model.to(env.device).eval()


@torch.inference_mode()
def hf_generate_batch(model, batch: list[Request], pad_id: int, device: torch.device) -> int:
    """One static batch: left padding (so every row's last prompt token is at the same
    position), greedy, max_new_tokens = the longest request's, no EOS so nothing stops
    early. Returns the tokens generated per row."""
    from transformers import GenerationConfig

    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    new = max(r.output_len for r in batch)
    config = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=pad_id, use_cache=True)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return out.shape[1] - width


def run_transformers(env: BenchEnv, reqs: list[Request], batch_size: int) -> dict:
    model = load_transformers(env)
    # The model's own generation config would fill an EOS back in: clear it.
    model.generation_config.eos_token_id = None
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None or isinstance(pad_id, list) else int(pad_id)
    hf_generate_batch(model, [Request(reqs[0].prompt_ids[:16], 2)], pad_id, env.device)  # warm up
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    sync(env.device)
    t0 = time.perf_counter()
    generated = 0
    for k, batch in enumerate(batches):
        progress(f"transformers: batch {k + 1}/{len(batches)} ({len(batch)} requests)")
        n = hf_generate_batch(model, batch, pad_id, env.device)
        if n != max(r.output_len for r in batch):
            raise NanoinferError(f"transformers stopped after {n} of {max(r.output_len for r in batch)} tokens")
        generated += n * len(batch)
    sync(env.device)
    seconds = time.perf_counter() - t0
    progress_done()
    del model
    gc.collect()
    useful = sum(r.output_len for r in reqs)
    res = figures(reqs, useful, seconds)
    res.update({"batch_size": batch_size, "batches": len(batches), "generated_tokens_incl_waste": generated})
    return res


def check_ranges(a: argparse.Namespace) -> None:
    for flag in ("num_requests", "max_num_seqs", "max_num_batched_tokens", "hf_batch_size"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            raise NanoinferError(f"--{flag.replace('_', '-')} must be >= 1")
    for name in ("input", "output"):
        lo, hi = getattr(a, f"min_{name}_len"), getattr(a, f"max_{name}_len")
        if lo < 1 or hi < lo:
            raise NanoinferError(f"--min-{name}-len {lo} / --max-{name}-len {hi}: need 1 <= min <= max")


def run(args: argparse.Namespace) -> int:
    gpu = on_gpu(args)
    # nano-vllm's bench on a GPU (256 requests, lengths 100..1024); a 2-core CPU gets a
    # run of tens of seconds.
    defaults = ({"num_requests": 256, "min_input_len": 100, "max_input_len": 1024, "min_output_len": 100,
                 "max_output_len": 1024, "max_num_batched_tokens": 16384} if gpu else
                {"num_requests": 32, "min_input_len": 16, "max_input_len": 256, "min_output_len": 16,
                 "max_output_len": 128, "max_num_batched_tokens": 1024})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    check_ranges(args)
    compare = args.compare
    if compare not in (None, "transformers"):
        raise NanoinferError(f"--compare {compare!r}: only 'transformers' is supported")
    plot = plot_path(args)
    env = setup(args, need_peaks=False)
    max_len = env.loaded.config.max_position_embeddings
    if args.max_input_len + args.max_output_len > max_len:
        raise NanoinferError(f"--max-input-len + --max-output-len = {args.max_input_len + args.max_output_len} "
                             f"exceeds the model's context of {max_len}")
    reqs = make_requests(args.num_requests, (args.min_input_len, args.max_input_len),
                         (args.min_output_len, args.max_output_len), env.loaded.config.vocab_size, args.seed)
    max_num_seqs = args.max_num_seqs or min(len(reqs), 256)
    budget = max(args.max_num_batched_tokens, args.max_input_len)  # a prompt fits one step
    print(f"model {env.loaded.path.name} ({env.loaded.format}), {env.dtype} on {env.device}, "
          f"{torch.get_num_threads()} threads")
    print(f"{len(reqs)} requests, input {args.min_input_len}..{args.max_input_len}, output "
          f"{args.min_output_len}..{args.max_output_len} tokens (uniform, seed {args.seed}), greedy, ignore_eos")
    if args.rounds < 1 or (args.rounds > 1 and args.structured is None):
        raise NanoinferError("--rounds must be at least 1, and more than 1 only with --structured")
    rounds = []
    for _ in range(args.rounds):  # alternated, so that drift in the machine's speed hits both alike
        free = run_engine(env, reqs, max_num_seqs, budget)
        constrained = (run_engine(env, reqs, max_num_seqs, budget, StructuredOutputsParams(json=BENCH_SCHEMA))
                       if args.structured == "json" else None)
        rounds.append((free, constrained))
    mid = sorted(range(len(rounds)), key=lambda i: rounds[i][0]["output_tok_s"])[len(rounds) // 2]
    results = {"nanoinfer": rounds[mid][0]}
    if args.structured == "json":
        results["nanoinfer_json"] = sorted((c for _, c in rounds), key=lambda r: r["output_tok_s"])[len(rounds) // 2]
    if compare == "transformers":
        results["transformers"] = run_transformers(env, reqs, args.hf_batch_size or min(32, len(reqs)))
    print()
    rows = [[name, f"{r['wall_s']:.2f}", f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
             f"{r['requests_per_s']:.2f}"] for name, r in results.items()]
    print_table(["engine", "wall s", "output tok/s", "total tok/s", "req/s"], rows)
    ni = results["nanoinfer"]
    print(f"\nnanoinfer: {ni['steps']} steps, {ni['preemptions']} preemptions, KV pool "
          f"{fmt_bytes(ni['kv_cache_bytes'])}, TTFT median {ni['ttft_median_s']:.2f}s / p90 {ni['ttft_p90_s']:.2f}s")
    if "ttft_median_s_by_priority" in ni:
        print("TTFT median by priority: " + ", ".join(f"{p}: {t:.2f}s" for p, t in ni["ttft_median_s_by_priority"].items()))
    out = {**run_meta(env, "throughput", with_transformers=compare == "transformers"),
           "config": {k: getattr(args, k) for k in ("num_requests", "min_input_len", "max_input_len",
                                                     "min_output_len", "max_output_len", "seed")},
           "results": results}
    if args.structured == "json":
        js = results["nanoinfer_json"]
        ratio = js["output_tok_s"] / ni["output_tok_s"]
        print(f"nanoinfer with every request under a JSON schema: {js['output_tok_s']:.1f} output tok/s, "
              f"{ratio:.2f}x the unconstrained run; grammar masks {js['mask_ms_per_step']:.2f} ms per step "
              f"({js['steps']} steps), {js['closed_early']} outputs closed their JSON before their length")
        out["ratio_structured_output_tok_s"] = ratio
        if len(rounds) > 1:
            out["rounds_output_tok_s"] = [[f["output_tok_s"], c["output_tok_s"]] for f, c in rounds]
            print("rounds (free, constrained output tok/s): "
                  + ", ".join(f"{f['output_tok_s']:.1f}/{c['output_tok_s']:.1f}" for f, c in rounds)
                  + "; the table shows each run's median")
    if compare == "transformers":
        hf = results["transformers"]
        ratio = ni["output_tok_s"] / hf["output_tok_s"]
        print(f"transformers: static batches of {hf['batch_size']}, {hf['generated_tokens_incl_waste']} tokens "
              f"generated for {hf['output_tokens']} useful")
        print(f"nanoinfer / transformers (output tok/s): {ratio:.2f}x")
        out["ratio_output_tok_s"] = ratio
    if plot:
        from .plots import plot_throughput
        plot_throughput(plot, results, f"{env.loaded.path.name}, {len(reqs)} requests, {env.dtype}")
        print(f"plot: {plot}")
    out["plot"] = plot
    emit_json(out)
    return 0
