"""The flags several commands share, defined once: the model (`--model`, `--dtype`,
`--max-model-len`), the engine (`--max-num-seqs`, ...) and sampling (`--temperature`, ...),
with what turns them into `SamplingParams` and engine arguments, and `run_command`, which
prints a command's error as one line.

`nanoinfer generate/chat/tokenize` (cli.py), `serve` (server/cli.py) and `bench`
(bench/cli.py) build their parsers on this module, so it sits below all three and imports
none of them: cli.py imports server.cli and bench.cli, never the other way round.

A command whose default is known only later (bench sizes its engine per device) passes the
default as text: the flag then parses to None and its help shows the text.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import NanoinferError
from .sampling import SamplingParams

# The KV cache's formats (engine/core.py's KV_CACHE_DTYPES, attention/kv_cache.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "q8_0")

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def milliseconds_or_off(text: str) -> float | None:
    """A time in ms (finite, > 0), or 0 / "off" for none."""
    if text.strip().lower() in ("0", "off", "none"):
        return None
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of ms > 0, or 0 for none; got {text}")
    return value


def byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 65536, 64K, 2G."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64K, 2G)") from None


def _default(value: int | str) -> tuple[int | None, str]:
    """(what the flag parses to when absent, what its help shows)."""
    return (None, value) if isinstance(value, str) else (value, str(value))


# --- the model ---------------------------------------------------------------------------
def add_model_arg(p: argparse.ArgumentParser) -> None:
    """`--model` alone, for commands that read only the tokenizer."""
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, Hugging Face folder or nanochat checkpoint "
                        "(default: SmolLM2-135M-Instruct GGUF)")


def add_model_args(p: argparse.ArgumentParser, *, dtype: str | None = "auto", dtype_rule: str = "",
                   max_model_len: bool = True, device: str | None = "cpu",
                   device_rule: str = "cuda when available", threads: bool = True,
                   attention_backend: bool = True) -> None:
    """--model, --dtype, --device, --threads (unless threads=False: bench has its own),
    (unless max_model_len=False) --max-model-len and (unless attention_backend=False: a
    command with no KV cache) --attention-backend. dtype=None or device=None: the command picks
    one later, as `dtype_rule` or `device_rule` tells the help."""
    add_model_arg(p)
    if threads:
        p.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads for the model, shared equally by replicas or tensor-parallel "
                            "ranks (default: the physical cores)")
    p.add_argument("--dtype", default=dtype,
                   help=f"auto (a GGUF as stored, on the block-format kernels) | float32 | bfloat16 | float16 "
                        f"(default {dtype or dtype_rule})")
    p.add_argument("--device", default=device, help=f"cpu | cuda | cuda:N (default {device or device_rule})")
    if attention_backend:
        p.add_argument("--attention-backend", default="auto", metavar="NAME",
                       help="cpu (the compiled CPU kernel) | torch (plain PyTorch, any device) | a backend registered "
                            "by name (default auto: the first of those that runs on the device and KV dtype)")
    if max_model_len:
        p.add_argument("--max-model-len", type=positive_int, default=None, help="context window (default: the model's)")


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    """--speculative-config, for the commands that decode with an engine."""
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)')


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# --- the engine --------------------------------------------------------------------------
def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs: int | str = 64,
                    max_num_batched_tokens: int | str = 512, kv_cache: bool = True,
                    tensor_parallel: bool = False, step_time_target_ms: float | None = None) -> None:
    """The scheduler's limits and (unless kv_cache=False) the KV cache's size and prefix
    caching, in an "engine" group, and --tensor-parallel-size where the command builds its
    model through LLM. Each command passes its own defaults."""
    g = p.add_argument_group("engine")
    if tensor_parallel:
        g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="split the model over N processes (torch.distributed; default 1)")
    default, shown = _default(max_num_seqs)
    g.add_argument("--max-num-seqs", type=positive_int, default=default,
                   help=f"sequences running in one step (default {shown})")
    default, shown = _default(max_num_batched_tokens)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=default,
                   help=f"tokens in one step, prefill chunks included (default {shown})")
    g.add_argument("--step-time-target-ms", type=milliseconds_or_off, default=step_time_target_ms, metavar="MS",
                   help="a step that decodes takes about this long: prompt chunks beside decodes are sized to fit, so "
                        "streams keep their cadence while prompts prefill; 0: the token budget alone (default "
                        f"{'0' if step_time_target_ms is None else f'{step_time_target_ms:g}'})")
    if kv_cache:
        g.add_argument("--kv-cache-memory", type=byte_size, default=None,
                       help="bytes for the KV cache (default: room for --max-num-seqs full contexts, at most a quarter "
                            "of the available memory)")
        g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="the KV cache's dtype: auto (bfloat16 for GGUF weights run in their blocks on the CPU, "
                            "else the model's dtype) | float32 | bfloat16 | q8_0 (8-bit blocks: 0.53x bf16's bytes)")
        g.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
        g.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="also keep full KV blocks in DIR, read back after a restart (shared by replicas; "
                            "a folder per model and configuration inside; default: memory only)")
        g.add_argument("--prefix-cache-dir-size", type=byte_size, default=4 << 30, metavar="BYTES",
                       help="the most --prefix-cache-dir holds for one model, least recently used blocks "
                            "deleted past it (default 4G)")
    g.add_argument("--scheduling-policy", default="fcfs",
                   help="fcfs (default), priority (requests with a lower `priority` value are admitted first and "
                        "preempted last), or another name in engine/policy.py's POLICIES")
    g.add_argument("--structured-outputs-config", type=json_object, default=None, metavar="JSON",
                   help='limits on a request\'s structured-output constraint, e.g. \'{"mask_budget_seconds": 0.2, '
                        '"compile_seconds": 10, "max_rules": 5000, "max_schema_depth": 1000}\' '
                        '(default: those; see docs/serving.md)')


def engine_kwargs(a: argparse.Namespace) -> dict:
    """add_engine_args' flags (kv_cache=True), and add_model_args' --attention-backend, as
    `LLM(...)`'s engine arguments."""
    return dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                kv_cache_memory=a.kv_cache_memory, kv_cache_dtype=a.kv_cache_dtype,
                attention_backend=a.attention_backend,
                enable_prefix_caching=not a.no_prefix_caching, prefix_cache_dir=a.prefix_cache_dir,
                prefix_cache_dir_bytes=a.prefix_cache_dir_size,
                tensor_parallel_size=getattr(a, "tensor_parallel_size", 1),
                constraint_limits=a.structured_outputs_config, scheduling_policy=a.scheduling_policy,
                step_time_target_ms=a.step_time_target_ms)


# --- sampling ----------------------------------------------------------------------------
def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    # Defaults follow llama.cpp's CLI: a small model at temperature 1.0 rambles.
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="(default 0.95)")
    p.add_argument("--top-k", type=int, default=40, help="(default 40)")
    p.add_argument("--min-p", type=float, default=0.05, help="(default 0.05)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="(default 1.0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="(default 0.0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="(default 0.0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampling (default: random)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """add_sampling_args' flags as SamplingParams (which validates them: NanoinferError). A
    temperature above 2 is allowed but said: llama.cpp users write -t 8 meaning 8 threads."""
    if a.temperature > 2:
        print(f"note: temperature {a.temperature:g} (-t is the temperature here; threads are --threads)",
              file=sys.stderr)
    return SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.max_tokens,
        stop=a.stop, ignore_eos=a.ignore_eos)


# --- running -----------------------------------------------------------------------------
def run_command(a: argparse.Namespace) -> int:
    """Run the parsed command (`a.func`). An error is one line `error: ...` and status 1;
    a closed pipe (`| head`) is a normal end."""
    try:
        if hasattr(a, "threads"):
            from . import threads
            threads.use(a.threads)
        return a.func(a) or 0
    except NanoinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
