"""`bench latency --speculative METHOD`: batch-1 decode with and without speculation, on
tasks where the output copies its input and on one where it does not.

The tasks are chat prompts built from text the package ships, so every install runs the same
ones: rewrite a source file of this package with one function renamed (input-grounded: the
answer repeats the file), copy a paragraph of a document made of this package's module
docstrings (input-grounded: its longest paragraph, named by its first words), and write a
short story (lookup rarely right). Each task runs greedy for `--decode-len` tokens, `--runs`
times with speculation and without, alternating; decode tok/s is (tokens - 1) / (time from
the first token to the last), the medians are compared. Acceptance: accepted / proposed
guesses, and tokens per verifying step."""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import time
from dataclasses import replace

from ..engine import EngineConfig, LLMEngine
from ..errors import NanoinferError
from ..sampling import SamplingParams
from .common import BenchEnv, median, print_table, progress, progress_done

# k = 3: on a 2-core AVX2 CPU checking 3 guesses costs ~1.5 single-token steps, 4 guesses
# ~2.5 (the block-format GEMV turns compute-bound past a few rows); measured on Qwen2.5-Coder
# 1.5B Q4_K_M, code edit: 2.29x at k = 3, 2.14x at k = 2, 1.61x at k = 4. Since the AVX2 tiles
# take 5 rows in one pass, k = 4 there: code edit faster, document quote slower (docs/benchmarks.md,
# the eighth Zen 4 section), so 3 stays.
DEFAULT_CONFIGS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                             "prompt_lookup_min": 2},
                   "draft_model": {"method": "draft_model", "num_speculative_tokens": 3}}


def tasks() -> dict[str, tuple[str, str, str]]:
    """name -> (text before the material, the material, text after it)."""
    from .. import sampling
    from ..engine import core, kv_manager, scheduler
    from ..spec_decode import proposer

    code = inspect.getsource(proposer)
    document = "\n\n".join(inspect.getdoc(m) or "" for m in (core, kv_manager, scheduler, sampling))
    # The paragraph to quote is named by its first words, and is the document's longest, so that
    # the task stays a whole paragraph's copy as the docstrings change. (Named by its subject, it
    # came to be a one-sentence answer: once the docstring it meant was rewritten, Qwen2.5-Coder
    # 1.5B quoted a 15-token sentence of another paragraph.)
    opening = " ".join(max(document.split("\n\n"), key=len).split()[:3])
    return {
        "code-edit": ("Rewrite this Python file, renaming the method `propose_many` to `guess_many`. "
                      "Output only the code.\n\n", code, ""),
        "doc-quote": ("", document, f"\n\nCopy, word for word and in full, the paragraph of the text above that begins "
                                    f"with \"{opening}\"."),
        "free": ("Write a short story about a dragon who learns to bake bread.", "", ""),
    }


def task_prompt(tokenizer, parts: tuple[str, str, str], room: int) -> list[int]:
    """The task's chat prompt in at most `room` tokens: a model with a short context gets the
    material cut (from its end) until it fits."""
    before, material, after = parts
    while True:
        ids = tokenizer.encode_chat([{"role": "user", "content": before + material + after}])
        if len(ids) <= room or not material:
            return ids
        material = material[:len(material) * 3 // 4]


def speculative_config(args: argparse.Namespace) -> dict:
    config = dict(DEFAULT_CONFIGS[args.speculative])
    if args.speculative_config is not None:
        config.update(args.speculative_config)
    if config["method"] != args.speculative:
        raise NanoinferError(f"--speculative {args.speculative} with a speculative config of method "
                             f"{config['method']!r}")
    if config["method"] == "draft_model" and not config.get("model"):
        raise NanoinferError("--speculative draft_model needs the draft's path: "
                             "--speculative-config '{\"model\": \"PATH\"}'")
    return config


def decode_once(engine: LLMEngine, prompt: list[int], decode_len: int) -> dict:
    proposed, accepted, checks = engine.spec_proposed, engine.spec_accepted, engine.spec_checks
    steps0 = engine.total_steps
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=decode_len))
    times = []
    while engine.has_unfinished():
        deltas = engine.step()
        if any(d.token_ids for d in deltas):
            times.append(time.perf_counter())
    out = engine.release("r").outputs[0]
    n = len(out.token_ids)
    return {"tokens": n, "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 else 0.0,
            "steps": engine.total_steps - steps0, "proposed": engine.spec_proposed - proposed,
            "accepted": engine.spec_accepted - accepted, "checks": engine.spec_checks - checks,
            "token_ids": out.token_ids}


def run_speculative(env: BenchEnv, args: argparse.Namespace, decode_len: int) -> dict:
    config = speculative_config(args)
    runs = args.runs
    if runs < 1:
        raise NanoinferError("--runs must be >= 1")
    context = env.loaded.config.max_position_embeddings
    if decode_len >= context // 2:
        raise NanoinferError(f"--decode-len {decode_len}: at most half the context of {context}")
    prompts = {name: task_prompt(env.loaded.tokenizer, parts, context - decode_len)
               for name, parts in tasks().items()}
    max_len = min(max(map(len, prompts.values())) + decode_len + 32, context)
    base_cfg = EngineConfig(max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=max_len,
                            attention_backend=env.args.attention_backend, kv_cache_dtype=env.args.kv_cache_dtype)
    engines = {"off": LLMEngine(env.loaded, base_cfg),
               "on": LLMEngine(env.loaded, replace(base_cfg, speculative_config=config))}
    for e in engines.values():  # first calls pay for lazy set-up
        decode_once(e, prompts["free"][:16], 4)
    results = {}
    for name, prompt in prompts.items():
        rounds: dict[str, list[dict]] = {"off": [], "on": []}
        for i in range(runs):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                progress(f"{name}: run {i + 1}/{runs}, speculation {mode} ...")
                rounds[mode].append(decode_once(engines[mode], prompt, decode_len))
        progress_done()
        off, on = rounds["off"], rounds["on"]
        if any(r["token_ids"] != off[0]["token_ids"] for r in off + on):
            raise NanoinferError(f"task {name}: greedy output differs with speculation (a bug: please report it)")
        proposed, accepted = sum(r["proposed"] for r in on), sum(r["accepted"] for r in on)
        off_tps, on_tps = median([r["decode_tok_s"] for r in off]), median([r["decode_tok_s"] for r in on])
        results[name] = {
            "prompt_tokens": len(prompt), "tokens": off[0]["tokens"],
            "off_decode_tok_s": [r["decode_tok_s"] for r in off], "on_decode_tok_s": [r["decode_tok_s"] for r in on],
            "speedup": on_tps / off_tps if off_tps else 0.0,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "tokens_per_step": sum(r["tokens"] for r in on) / sum(r["steps"] for r in on),
            "mean_accepted_tokens": sum(r["accepted"] for r in on) / max(1, sum(r["checks"] for r in on)),
        }
    del engines
    gc.collect()
    return {"config": config, "runs": runs, "decode_len": decode_len, "tasks": results}


def print_speculative(res: dict) -> None:
    print(f"speculative decoding at batch 1, {json.dumps(res['config'])}, greedy, up to {res['decode_len']} tokens, "
          f"{res['runs']} alternating runs each (medians)")
    rows = [[name, str(r["prompt_tokens"]), str(r["tokens"]), f"{median(r['off_decode_tok_s']):.1f}",
             f"{median(r['on_decode_tok_s']):.1f}", f"{r['speedup']:.2f}x", f"{r['acceptance_rate']:.0%}",
             f"{r['tokens_per_step']:.2f}"] for name, r in res["tasks"].items()]
    print_table(["task", "prompt", "tokens", "decode tok/s off", "on", "speed-up", "accepted", "tokens/step"], rows)
