"""The `bench` subcommand. `add_bench_parser(sub)` hooks it into nanoinfer's CLI;
`main()` serves `python -m nanoinfer.bench` with a parser of its own, so this module never
imports nanoinfer.cli (which imports it). The model and engine flags come from cli_args.py.
Each bench module is imported only when its command runs, so `nanoinfer --help` stays fast."""
from __future__ import annotations

import argparse

from ..cli_args import KV_CACHE_DTYPES, add_engine_args, add_model_args, add_speculative_arg, positive_int, run_command
from ..kernels.quant import PATH_NAMES


def _add_threads(p: argparse.ArgumentParser) -> None:
    # run_command sets them before the bench runs (threads.use)
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: the physical cores)")


def _common(p: argparse.ArgumentParser, peaks: bool = False, plot: bool = True) -> None:
    # the dtype is picked once the device is known (common.setup)
    add_model_args(p, dtype=None, dtype_rule="bfloat16 on CUDA, float32 on CPU", max_model_len=False, device=None,
                   threads=False)
    _add_threads(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    if plot:
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


def _serve(a: argparse.Namespace) -> int:
    from .serve import run
    return run(a)


def _soak(a: argparse.Namespace) -> int:
    from .soak import run
    return run(a)


def _sampler(a: argparse.Namespace) -> int:
    from .sampler import run
    return run(a)


def _linears(a: argparse.Namespace) -> int:
    from .linears import run
    return run(a)


def _verify(a: argparse.Namespace) -> int:
    from .verify import run
    return run(a)


def _add_commands(sub) -> None:
    lat = sub.add_parser("latency", help="TTFT, TPOT, tok/s, MBU and MFU per batch size, against the roofline",
                         description="Prefill B prompts in one step, then decode; per batch size.")
    _common(lat, peaks=True)
    lat.add_argument("--prompt-len", default=None,
                     help="prompt tokens (default 128 on CPU, 2048 on GPU; clamped to context - decode); with "
                          "--compare a comma-separated list, each length compared in turn (e.g. 512,2048)")
    lat.add_argument("--decode-len", type=int, default=None, help="tokens generated (default 64 on CPU, 256 on GPU)")
    lat.add_argument("--batch-sizes", default=None,
                     help="comma-separated (default 1,8,32 on CPU, 1,8,32,128 on GPU; 1 with --compare)")
    lat.add_argument("--interleave", action="store_true",
                     help="prefill every batch size, then take one decode step of each in turn, so that each "
                          "TPOT is timed over the same stretch (ratios between batch sizes on a machine whose "
                          "speed drifts; each step then follows another batch size's, so a model that nearly "
                          "fits the last-level cache runs slower than alone); peak mem is then the whole run's")
    lat.add_argument("--cold-cache", action="store_true",
                     help="read a tensor far larger than the last-level cache before each timed step (untimed), "
                          "so the weights come from memory: a CPU whose cache is much smaller than the model "
                          "(a model that fits the cache streams from it at batch 1, far faster)")
    lat.add_argument("--compare", default=None, choices=["llama.cpp"],
                     help="then batch 1 against llama.cpp on the same GGUF file, threads, prompt and lengths, "
                          "run in a subprocess of --llama-cpp-python")
    lat.add_argument("--also", action="append", default=None, metavar="GGUF",
                     help="with --compare: one more GGUF file compared the same way after --model's, in this "
                          "process (repeatable); a table of every file's ratios ends the run")
    lat.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                     help="a Python with llama-cpp-python installed (default: $NANOINFER_LLAMA_CPP_PYTHON)")
    lat.add_argument("--speculative", default=None, choices=["ngram", "draft_model"],
                     help="instead of the batch sweep: batch-1 decode with and without speculation on an "
                          "input-grounded code edit, a document quote and a free story (fields of "
                          "--speculative-config override the defaults; draft_model needs its \"model\")")
    add_speculative_arg(lat)
    lat.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="the KV cache's format, as the engine takes it (default auto)")
    lat.add_argument("--runs", type=int, default=3,
                     help="rounds of --compare or --speculative, alternating which goes first; medians reported "
                          "(default 3)")
    lat.set_defaults(func=_latency)

    thr = sub.add_parser("throughput", help="N random requests at once, to completion (nano-vllm's protocol)",
                         description="Input and output lengths uniform in [min, max], ignore_eos, greedy.")
    _common(thr)
    thr.add_argument("--num-requests", "-n", type=int, default=None, help="default 32 on CPU, 256 on GPU")
    thr.add_argument("--min-input-len", type=int, default=None, help="default 16 on CPU, 100 on GPU")
    thr.add_argument("--max-input-len", type=int, default=None, help="default 256 on CPU, 1024 on GPU")
    thr.add_argument("--min-output-len", type=int, default=None, help="default 16 on CPU, 100 on GPU")
    thr.add_argument("--max-output-len", type=int, default=None, help="default 128 on CPU, 1024 on GPU")
    # the KV pool is sized to hold every request (common.kv_pool_bytes): no --kv-cache-memory
    add_engine_args(thr, max_num_seqs="min(N, 256)", max_num_batched_tokens="1024 on CPU, 16384 on GPU",
                    kv_cache=False)
    thr.add_argument("--compare", default=None, choices=["transformers"],
                     help="also run the same requests through transformers' generate()")
    add_speculative_arg(thr)
    thr.add_argument("--priority-levels", type=int, default=1,
                     help="request i gets priority i %% K (with --scheduling-policy priority: lower first); the "
                          "median TTFT of each level is reported (default 1: all 0)")
    thr.add_argument("--structured", default=None, choices=["json"],
                     help="also run every request under a JSON schema and compare (structured outputs)")
    thr.add_argument("--rounds", type=int, default=1,
                     help="with --structured: alternate the free and the constrained run this many times and "
                          "compare their medians (the machine's speed drifts between runs)")
    thr.add_argument("--hf-batch-size", type=int, default=None,
                     help="static batch size for transformers (default min(32, N))")
    thr.set_defaults(func=_throughput)

    loop = sub.add_parser("loop", help="per-forward time: uncached reference loop against the engine's cached loop")
    _common(loop)
    loop.add_argument("--prompt-len", type=int, default=None, help="default 64 on CPU, 512 on GPU")
    loop.add_argument("--output-len", type=int, default=None, help="default 192 on CPU, 512 on GPU")
    loop.add_argument("--rows", type=int, default=12,
                      help="rows of the table: the prefill, then buckets of contexts (default 12)")
    loop.set_defaults(func=_loop)

    # No model is loaded here (the server has it): none of _common's options apply.
    srv = sub.add_parser("serve", help="load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput",
                         description="Streamed requests of random words against any OpenAI-compatible server "
                                     "(nanoinfer, vLLM, llama.cpp), timed on the client; vLLM's figures.")
    srv.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    srv.add_argument("--model", "-m", default=None, help="model name to send (default: the first of GET /v1/models)")
    srv.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                     help="/v1/completions or /v1/chat/completions (default completions)")
    srv.add_argument("--num-requests", "-n", type=int, default=32, help="requests to send (default 32)")
    srv.add_argument("--request-rate", type=float, default=None,
                     help="Poisson arrivals per second; inf = all at once (default inf)")
    srv.add_argument("--concurrency", type=int, default=None, help="at most this many in flight (default no limit)")
    srv.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    srv.add_argument("--output-len", type=int, default=64, help="max_tokens (default 64)")
    srv.add_argument("--range-ratio", type=float, default=0.0,
                     help="lengths uniform in [L*(1-r), L*(1+r)] (default 0: exactly L)")
    srv.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every reply runs to max_tokens")
    srv.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts and arrivals (default 0)")
    srv.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                     help="SLOs of goodput, in ms: ttft:500 tpot:50 e2el:5000")
    srv.add_argument("--timeout", type=float, default=600.0,
                     help="seconds for the whole run, set-up included; what is unfinished then counts as failed "
                          "(default 600)")
    srv.add_argument("--request-timeout", type=float, default=None,
                     help="seconds for one request (default: the run's --timeout)")
    srv.add_argument("--warmup", type=int, default=1, help="untimed requests sent first (default 1)")
    srv.add_argument("--shared-prefixes", type=int, default=0, metavar="K",
                     help="start each request with one of K system prompts (--prefix-len words; each prompt an equal share "
                          "of the requests, in a seeded random order) and report the server's prefix-cache hit rate "
                          "(default 0: no shared prefixes)")
    srv.add_argument("--prefix-len", type=int, default=256, help="words per shared prefix (default 256)")
    srv.add_argument("--plot", default=None, metavar="FILE.png", help="also draw TTFT/E2E CDFs and the ITL histogram")
    srv.set_defaults(func=_serve)

    soak = sub.add_parser("soak", help="many mixed requests against a server it starts; the server's RSS as they go",
                          description="Completions, chat, streams, n=3, logprobs, JSON and regex constraints, and "
                                      "streams closed mid-prefill, in a seeded random order, against `nanoinfer serve` "
                                      "started here; VmRSS after every --every requests.")
    soak.add_argument("--model", "-m", default=None, help="the model to serve (default: the default model)")
    soak.add_argument("--kv-cache-memory", default=None, help="the server's KV pool (default: its own rule)")
    soak.add_argument("--requests", "-n", type=int, default=2000, help="requests to send (default 2000)")
    soak.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    soak.add_argument("--every", type=int, default=100, help="read RSS after every N requests (default 100)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the mix and the prompts (default 0)")
    soak.set_defaults(func=_soak)
    smp = sub.add_parser("sampler", help="a step's sampling: the batched sampler against the per-row path, in one run")
    smp.add_argument("--rows", type=int, default=256, help="rows sampled in the step (default 256)")
    smp.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152, SmolLM2's)")
    smp.add_argument("--spread", type=float, default=4.0, help="the logits' standard deviation (default 4)")
    smp.add_argument("--mixes", default="top_p,temperature,top_k,penalties,greedy+bias",
                     help="comma-separated sampling mixes (default all)")
    smp.add_argument("--repeats", type=int, default=3, help="alternating runs; the median is shown (default 3)")
    _add_threads(smp)
    smp.add_argument("--seed", type=int, default=0, help="seed of the logits (default 0)")
    smp.add_argument("--no-kernels", action="store_true",
                     help="the batched sampler's PyTorch path alone, without the compiled sampling")
    smp.set_defaults(func=_sampler)
    lin = sub.add_parser("linears", help="the block GEMM alone on a GGUF's own weights, per type and row count",
                         description="Each block type's weights, repacked as the model runs them, every weight once "
                                     "per row count (from memory, as a decode step meets them); median of runs.")
    lin.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    lin.add_argument("--rows", default="1,4,8", help="activation rows per call, comma-separated (default 1,4,8)")
    lin.add_argument("--runs", type=int, default=5, help="alternating runs; the median is shown (default 5)")
    lin.add_argument("--path", default="auto", choices=["auto", *PATH_NAMES],
                     help="the kernels' dispatch path (default auto: the fastest this CPU runs)")
    _add_threads(lin)
    lin.add_argument("--seed", type=int, default=0, help="seed of the activations (default 0)")
    lin.add_argument("--by", default="type", choices=["type", "shape"],
                     help="one line per block type, or per type and weight shape (N x K) (default type)")
    lin.add_argument("--weights", default="streamed", choices=["streamed", "cached"],
                     help="streamed: each weight once in turn, from memory as a decode step meets them; cached: "
                          "each timed call after three untimed ones on the same weight, from the caches where it "
                          "fits them (the kernels' compute rate) (default streamed)")
    lin.add_argument("--against", default=None, metavar="FLAGS",
                     help="a second build of the block GEMM with these compiler flags added (after "
                          "$NANOINFER_CXXFLAGS), e.g. --against='-UQG_NARROW_TILE_ROWS -DQG_NARROW_TILE_ROWS=0': both timed in "
                          "one process on the same weights, in turn, the order swapped each run; their outputs "
                          "must agree bit for bit")
    lin.set_defaults(func=_linears)
    ver = sub.add_parser("verify", help="a forward's time by its rows of one sequence: what checking guesses costs",
                         description="One prompt prefilled, then forwards of R rows at the next position (its token "
                                     "and R - 1 made-up guesses, as speculation checks them), each R in turn; "
                                     "medians, each against the first R.")
    _common(ver, plot=False)
    ver.add_argument("--rows", default="1,4,5,8", help="rows per forward, comma-separated (default 1,4,5,8)")
    ver.add_argument("--prompt-len", type=int, default=512, help="tokens before the rows (default 512)")
    ver.add_argument("--rounds", type=int, default=20, help="forwards of each row count (default 20)")
    ver.set_defaults(func=_verify)


DESCRIPTION = ("Benchmarks. Tables on stdout, progress on stderr; the last stdout line is one JSON document "
               "with every figure.")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add `bench {latency,throughput,loop,serve,soak,sampler,linears,verify}` to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks: latency, throughput, loop, serve, soak, sampler, linears, verify",
                                  description=DESCRIPTION)
    _add_commands(bench.add_subparsers(dest="bench_command", required=True))
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoinfer.bench ...` is `nanoinfer bench ...`."""
    p = argparse.ArgumentParser(prog="python -m nanoinfer.bench", description=DESCRIPTION)
    _add_commands(p.add_subparsers(dest="bench_command", required=True))
    return run_command(p.parse_args(argv))
