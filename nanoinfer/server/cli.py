"""`nanoinfer serve`: load one model and serve it over HTTP until SIGINT/SIGTERM.

nanoinfer/cli.py adds this subcommand with `add_serve_parser(subparsers)`; `python -m
nanoinfer.server` runs it alone (`main`).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from ..errors import NanoinferError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 65536, 64K, 2G."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64K, 2G)") from None


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--max-model-len", type=_positive, default=None, help="context window (default: the model's)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the model file's or folder's name)")
    lim = p.add_argument_group("request limits")
    lim.add_argument("--max-n", type=_positive, default=16, help="largest n (default 16)")
    lim.add_argument("--max-tokens-limit", type=_positive, default=None,
                     help="largest max_tokens; also chat's default, and the cap of completions' 16 "
                          "(default: only the context window)")
    lim.add_argument("--max-prompts", type=_positive, default=64,
                     help="most prompts in one /v1/completions request (default 64)")
    lim.add_argument("--max-request-bytes", type=_size, default=1 << 20,
                     help="largest request body; larger gets 413 (default 1M)")
    lim.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="seconds in-flight requests get to finish on SIGINT/SIGTERM; then they are aborted "
                          "(default 5)")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection gets to send a request's headers before it is closed (default 10)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences in one batch (default 64)")
    eng.add_argument("--max-num-batched-tokens", type=_positive, default=512,
                     help="tokens in one step, prefill chunks included (default 512)")
    eng.add_argument("--kv-cache-memory", type=_size, default=1 << 30, help="bytes for the KV cache (default 1G)")
    eng.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page at /")
    configure(p)
    p.set_defaults(func=cmd_serve)
    return p


def default_name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def cmd_serve(a: argparse.Namespace) -> int:
    from ..llm import LLM
    from .app import serve
    from .serving import ServerConfig

    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=a.kv_cache_memory,
              enable_prefix_caching=not a.no_prefix_caching)
    lm = llm.loaded
    name = a.served_model_name or default_name(lm.path)
    print(f"[{lm.path.name}: {lm.format}, {lm.config.architecture}, context {llm.max_model_len}, "
          f"{llm.engine.blocks.num_free} KV blocks, loaded in {lm.load_seconds:.1f}s; serving as {name!r} "
          f"on http://{a.host}:{a.port}]", file=sys.stderr, flush=True)
    config = ServerConfig(model_name=name, max_n=a.max_n, max_tokens_limit=a.max_tokens_limit,
                          max_request_bytes=a.max_request_bytes, max_prompts=a.max_prompts,
                          shutdown_timeout=a.shutdown_timeout, header_timeout=a.header_timeout)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again for the previous handler:
    # make that an ordinary exit (status 0) rather than death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(llm.engine, config, host=a.host, port=a.port, log_level=a.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = configure(argparse.ArgumentParser(prog="python -m nanoinfer.server",
                                          description="nanoinfer's OpenAI-compatible HTTP server"))
    args = p.parse_args(argv)
    try:
        return cmd_serve(args)
    except NanoinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
