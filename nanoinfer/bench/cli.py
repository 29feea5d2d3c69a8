"""The `bench` subcommand. `add_bench_parser(sub)` hooks it into nanoinfer's CLI;
`main()` serves `python -m nanoinfer.bench`. Each bench module is imported only when
its command runs, so `nanoinfer --help` stays fast."""
from __future__ import annotations

import argparse
import sys



def _common(p: argparse.ArgumentParser, peaks: bool = False) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw a plot")
    if peaks:  # only latency relates figures to the hardware's peaks
        p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s (default: GPU table or CPU probe)")
        p.add_argument("--peak-bandwidth", type=float, default=None,
                       help="peak memory bandwidth in B/s (default: GPU table or CPU probe)")
        p.add_argument("--remeasure-peaks", action="store_true", help="probe again instead of using cached figures")


def _latency(a: argparse.Namespace) -> int:
    from .latency import run
    return run(a)


def _throughput(a: argparse.Namespace) -> int:
    from .throughput import run
    return run(a)


def _loop(a: argparse.Namespace) -> int:
    from .loop import run
    return run(a)


def _add_commands(sub) -> None:
    lat = sub.add_parser("latency", help="TTFT, TPOT, tok/s, MBU and MFU per batch size, against the roofline",
                         description="Prefill B prompts in one step, then decode; per batch size.")
    _common(lat, peaks=True)
    lat.add_argument("--prompt-len", type=int, default=None,
                     help="prompt tokens (default 128 on CPU, 2048 on GPU; clamped to context - decode)")
    lat.add_argument("--decode-len", type=int, default=None, help="tokens generated (default 64 on CPU, 256 on GPU)")
    lat.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32 on CPU, 1,8,32,128 on GPU)")
    lat.set_defaults(func=_latency)

    thr = sub.add_parser("throughput", help="N random requests at once, to completion (nano-vllm's protocol)",
                         description="Input and output lengths uniform in [min, max], ignore_eos, greedy.")
    _common(thr)
    thr.add_argument("--num-requests", "-n", type=int, default=None, help="default 32 on CPU, 256 on GPU")
    thr.add_argument("--min-input-len", type=int, default=None, help="default 16 on CPU, 100 on GPU")
    thr.add_argument("--max-input-len", type=int, default=None, help="default 256 on CPU, 1024 on GPU")
    thr.add_argument("--min-output-len", type=int, default=None, help="default 16 on CPU, 100 on GPU")
    thr.add_argument("--max-output-len", type=int, default=None, help="default 128 on CPU, 1024 on GPU")
    thr.add_argument("--max-num-seqs", type=int, default=None, help="engine: running sequences (default min(N, 256))")
    thr.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="engine: token budget per step (default 1024 on CPU, 16384 on GPU)")
    thr.add_argument("--compare", default=None, choices=["transformers"],
                     help="also run the same requests through transformers' generate()")
    thr.add_argument("--hf-batch-size", type=int, default=None, help="static batch size for transformers (default min(32, N))")
    thr.set_defaults(func=_throughput)

    loop = sub.add_parser("loop", help="per-forward time: uncached reference loop against the engine's cached loop")
    _common(loop)
    loop.add_argument("--prompt-len", type=int, default=None, help="default 64 on CPU, 512 on GPU")
    loop.add_argument("--output-len", type=int, default=None, help="default 192 on CPU, 512 on GPU")
    loop.add_argument("--rows", type=int, default=12, help="rows of the table: the prefill, then buckets of contexts (default 12)")
    loop.set_defaults(func=_loop)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench {latency,throughput,loop}` to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: latency, throughput, loop",
                                  description="Benchmarks. Tables on stdout, progress on stderr; the last stdout "
                                              "line is one JSON document with every figure.")
    _add_commands(bench.add_subparsers(dest="bench_command", required=True))
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoinfer.bench ...` is `nanoinfer bench ...`."""
    from ..cli import main as cli_main
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
