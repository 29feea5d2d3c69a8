"""`bench loop`: what the KV cache buys, forward by forward.

One request, greedy, ignore_eos, through two loops: the uncached reference
(nanoinfer.reference.generate_uncached: the whole sequence through the model every
step, so a forward's cost grows with the context) and the engine's cached loop (the
prompt once, then one token per step over the paged cache). Per-forward wall time is
tabled over the context lengths (median per bucket of contexts), with each loop's total and their ratio.

Timing: the uncached per-forward time is the model call alone; the cached one is a
whole engine step (schedule, forward, sample), so the comparison does not flatter the
engine. On CUDA both are synchronised before the clock is read.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from ..engine import EngineConfig, LLMEngine
from ..errors import NanoinferError
from ..models.batch import ForwardBatch
from ..reference import generate_uncached
from ..sampling import SamplingParams
from .common import (
    BLOCK_SIZE,
    BenchEnv,
    emit_json,
    kv_pool_bytes,
    median,
    on_gpu,
    plot_path,
    print_table,
    progress,
    progress_done,
    random_prompt,
    run_meta,
    setup,
    sync,
)


class _OnDevice(torch.nn.Module):
    """Synchronises after each forward of the reference loop, so its per-forward clock is
    honest on CUDA, and reports progress."""

    def __init__(self, model: torch.nn.Module, device: torch.device, total: int):
        super().__init__()
        self.model, self.device, self.total, self.calls = model, device, total, 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        out = self.model(batch)
        sync(self.device)
        self.calls += 1
        progress(f"uncached: forward {self.calls}/{self.total} (context {batch.input_ids.numel()})", throttle=True)
        return out


def run_uncached(env: BenchEnv, prompt: list[int], output_len: int) -> tuple[list[int], list[tuple[int, float]], float]:
    stats = []
    wrapped = _OnDevice(env.loaded.model, env.device, output_len)
    wrapped(ForwardBatch.whole(torch.tensor(prompt[:8], device=env.device)))  # warm up
    wrapped.calls = 0
    t0 = time.perf_counter()
    tokens, _ = generate_uncached(wrapped, prompt, output_len, eos_ids=frozenset(), stats=stats)
    total = time.perf_counter() - t0
    progress_done()
    return tokens, [(s.context_len, s.seconds) for s in stats], total


def run_cached(env: BenchEnv, prompt: list[int], output_len: int) -> tuple[list[int], list[tuple[int, float]], float]:
    total_len = len(prompt) + output_len
    engine = LLMEngine(env.loaded, EngineConfig(
        max_model_len=total_len, kv_cache_memory=kv_pool_bytes(env.roofline, [total_len, 16], BLOCK_SIZE),
        block_size=BLOCK_SIZE, max_num_seqs=1, max_num_batched_tokens=max(len(prompt), 16),
        enable_prefix_caching=False,  # the warm-up must not hand the run a cached prefix
        attention_backend=env.args.attention_backend))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("warmup", prompt[:8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.release("warmup")

    per_step: list[tuple[int, float]] = []
    sync(env.device)
    t0 = time.perf_counter()
    engine.add_request("0", prompt, params)
    seq = engine.requests["0"][0]
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step()
        sync(env.device)
        per_step.append((seq.stats.forwards[-1].context_len, time.perf_counter() - s0))
        progress(f"cached: step {len(per_step)}/{output_len}", throttle=True)
    total = time.perf_counter() - t0
    progress_done()
    return engine.release("0").outputs[0].token_ids, per_step, total


def bucket_rows(contexts: list[int], n: int) -> list[list[int]]:
    """The prefill on its own row, then the decode contexts in about n-1 consecutive
    buckets: a row shows the median of its bucket, so one forward slowed by other work on
    the machine does not pass for the curve."""
    first, rest = contexts[:1], contexts[1:]
    k = max(1, min(n - 1, len(rest)))
    buckets = [rest[len(rest) * i // k:len(rest) * (i + 1) // k] for i in range(k)]
    return [first] + [b for b in buckets if b]


def run(args: argparse.Namespace) -> int:
    gpu = on_gpu(args)
    prompt_len = args.prompt_len or (512 if gpu else 64)
    output_len = args.output_len or (512 if gpu else 192)
    if prompt_len < 1 or output_len < 1:
        raise NanoinferError("--prompt-len and --output-len must be >= 1")
    plot = plot_path(args)
    env = setup(args, need_peaks=False)
    max_len = env.loaded.config.max_position_embeddings
    if prompt_len + output_len > max_len:
        raise NanoinferError(f"--prompt-len + --output-len = {prompt_len + output_len} exceeds the model's "
                             f"context of {max_len}")
    prompt = random_prompt(random.Random(args.seed), prompt_len, env.loaded.config.vocab_size)
    print(f"model {env.loaded.path.name} ({env.loaded.format}), {env.dtype} on {env.device}, "
          f"{torch.get_num_threads()} threads; prompt {prompt_len}, output {output_len} tokens, greedy")
    ref_tokens, ref_steps, ref_total = run_uncached(env, prompt, output_len)
    eng_tokens, eng_steps, eng_total = run_cached(env, prompt, output_len)

    ref_by_ctx, eng_by_ctx = dict(ref_steps), dict(eng_steps)
    rows = []
    for bucket in bucket_rows(sorted(set(ref_by_ctx) & set(eng_by_ctx)), args.rows):
        r, e = median([ref_by_ctx[c] for c in bucket]), median([eng_by_ctx[c] for c in bucket])
        rows.append({"context": bucket[0], "context_end": bucket[-1], "uncached_s": r, "cached_s": e, "ratio": r / e})
    print()
    print_table(["context", "uncached ms", "cached ms", "uncached/cached"],
                [[f"{x['context']} (prefill)" if x["context"] == prompt_len else f"{x['context']}-{x['context_end']}",
                  f"{x['uncached_s'] * 1e3:.1f}", f"{x['cached_s'] * 1e3:.1f}", f"{x['ratio']:.1f}x"] for x in rows])
    print("(a row: the median forward of its contexts; the prefill row is the engine's whole-prompt forward)")
    diverge = next((i for i, (a, b) in enumerate(zip(ref_tokens, eng_tokens)) if a != b), None)
    print(f"\ntotal: uncached {ref_total:.2f}s ({len(ref_steps)} forwards), cached {eng_total:.2f}s "
          f"({len(eng_steps)} steps); uncached/cached = {ref_total / eng_total:.1f}x")
    print("tokens: identical" if diverge is None and ref_tokens == eng_tokens else
          f"tokens: first differ at output position {diverge} (rounding differences between the two paths)")
    if plot:
        from .plots import plot_loop
        plot_loop(plot, ref_steps, eng_steps, f"{env.loaded.path.name}, {env.dtype}, {env.device}, "
                                              f"prompt {prompt_len} + {output_len} tokens")
        print(f"plot: {plot}")
    emit_json({**run_meta(env, "loop"), "prompt_len": prompt_len, "output_len": output_len,
               "uncached": {"total_s": ref_total, "forwards": len(ref_steps),
                            "tok_s": len(ref_tokens) / ref_total, "per_forward": ref_steps},
               "cached": {"total_s": eng_total, "steps": len(eng_steps),
                          "tok_s": len(eng_tokens) / eng_total, "per_step": eng_steps},
               "ratio_total": ref_total / eng_total, "table": rows,
               "tokens_match": ref_tokens == eng_tokens, "first_divergence": diverge, "plot": plot})
    return 0
