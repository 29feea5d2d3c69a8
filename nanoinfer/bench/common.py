"""What every bench shares: device and dtype choice, loading, peaks, timing, memory,
progress on stderr, random prompts, and the final JSON line."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import sys
import time
from dataclasses import dataclass

import torch

from .. import threads
from ..errors import NanoinferError
from ..kernels.quant_linear import has_block_weights, parameter_count
from ..models.builder import LoadedModel
from .peaks import Peaks, cpu_model, device_name, peaks_dict, resolve_peaks
from .roofline import Roofline

# Every bench's engines page their KV cache in blocks of this many tokens.
BLOCK_SIZE = 16


def on_gpu(args: argparse.Namespace) -> bool:
    """Whether the run will be on a GPU: defaults are sized per device before loading."""
    return resolve_device(args.device).type == "cuda"


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NanoinferError(f"--device {name!r}: not a torch device (cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanoinferError("--device cuda: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise NanoinferError(f"--device {name!r}: only cpu and cuda are supported")
    return device


def default_dtype(device: torch.device) -> str:
    # The device's compute dtype: bf16 where tensor cores make it fast, fp32 on CPU.
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


@dataclass
class BenchEnv:
    args: argparse.Namespace
    device: torch.device
    dtype: str
    loaded: LoadedModel
    peaks: Peaks
    roofline: Roofline


def setup(args: argparse.Namespace, need_peaks: bool = True) -> BenchEnv:
    """Threads, device, dtype, the model, the peaks: in that order, since the CPU probe
    must run with the threads the engine will use."""
    from ..llm import DTYPES
    from ..models.builder import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise NanoinferError("--threads must be >= 1")
        threads.use(args.threads)
    device = resolve_device(args.device)
    dtype = args.dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise NanoinferError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    peak_flops, peak_bandwidth = getattr(args, "peak_flops", None), getattr(args, "peak_bandwidth", None)
    for flag, value in (("peak_flops", peak_flops), ("peak_bandwidth", peak_bandwidth)):
        if value is not None and not value > 0:
            raise NanoinferError(f"--{flag.replace('_', '-')} must be > 0")
    progress(f"loading {args.model or 'the default model'} ({dtype} on {device}) ...")
    loaded = load_model(args.model, dtype=DTYPES[dtype], device=device)
    progress_done()
    if need_peaks:
        peaks = resolve_peaks(device, DTYPES[dtype] or torch.float32, peak_flops, peak_bandwidth,
                              getattr(args, "remeasure_peaks", False), block=has_block_weights(loaded.model))
    else:
        peaks = Peaks(0.0, 0.0, "unused", device_name(device))
    kv = getattr(args, "kv_cache_dtype", "auto")
    return BenchEnv(args, device, dtype, loaded, peaks, Roofline.for_model(loaded.model, loaded.config, kv))


# --- timing and memory ------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """CUDA runs asynchronously: without a sync a timer measures only the kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the allocator's high-water mark since the last reset. CPU: the process's RSS
    high-water mark, which never goes down (so a later figure includes earlier ones)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def kv_pool_bytes(roofline: Roofline, seq_lens: list[int], block_size: int) -> int:
    """A KV pool that holds every sequence at its full length at once, plus a block of
    slack per sequence, so that a benchmark never measures preemption."""
    blocks = sum(-(-n // block_size) + 1 for n in seq_lens)
    return blocks * block_size * roofline.kv_bytes_per_token


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


# --- output ------------------------------------------------------------------------------
_last_progress = [0.0]


def progress(msg: str, throttle: bool = False) -> None:
    """One overwritten status line on stderr (stdout stays for tables and the JSON)."""
    now = time.perf_counter()
    if throttle and now - _last_progress[0] < 0.25:
        return
    _last_progress[0] = now
    sys.stderr.write(f"\r\033[K{msg}" if sys.stderr.isatty() else f"{msg}\n" if not throttle else "")
    sys.stderr.flush()


def progress_done() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def parse_counts(text: str, flag: str, example: str) -> list[int]:
    """A flag's comma-separated positive integers (batch sizes, row counts)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise NanoinferError(f"{flag} {text!r}: give integers separated by commas, e.g. {example}") from None
    if not counts or any(n < 1 for n in counts):
        raise NanoinferError(f"{flag} {text!r}: every value must be >= 1")
    return counts


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def versions(with_transformers: bool = False) -> dict:
    from .. import __version__
    v = {"python": platform.python_version(), "torch": torch.__version__, "nanoinfer": __version__}
    if with_transformers:
        import transformers
        v["transformers"] = transformers.__version__
    return v


def machine(device: torch.device) -> dict:
    m = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
        m["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return m


def run_meta(env: BenchEnv, bench: str, with_transformers: bool = False) -> dict:
    lm = env.loaded
    meta = {
        "bench": bench,
        "model": str(lm.path),
        "model_format": lm.format,
        "architecture": lm.config.architecture,
        "params": parameter_count(lm.model),
        "tensor_formats": lm.info.get("tensor_formats"),
        "device": str(env.device),
        "dtype": env.dtype,
        "threads": torch.get_num_threads(),
        "versions": versions(with_transformers),
        "machine": machine(env.device),
    }
    if env.peaks.source != "unused":
        meta["peaks"] = peaks_dict(env.peaks)
    return meta


def _finite(x):
    """JSON has no inf or NaN: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def emit_json(result: dict) -> None:
    """The last stdout line: one JSON document with every figure of the run."""
    sys.stdout.flush()
    print(json.dumps(_finite(result), allow_nan=False, default=str), flush=True)


def plot_path(args: argparse.Namespace) -> str | None:
    path = getattr(args, "plot", None)
    if path and not str(path).lower().endswith(".png"):
        raise NanoinferError(f"--plot {path!r}: give a .png file name")
    return path
