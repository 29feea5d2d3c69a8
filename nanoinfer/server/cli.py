"""`nanoinfer serve`: load one model and serve it over HTTP until SIGINT/SIGTERM.

nanoinfer/cli.py adds this subcommand with `add_serve_parser(subparsers)`; `python -m
nanoinfer.server` runs it alone (`main`). The model and engine flags come from cli_args.py;
this module never imports nanoinfer.cli.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from .. import threads
from ..cli_args import (
    add_engine_args,
    add_model_args,
    add_speculative_arg,
    byte_size,
    engine_kwargs,
    positive_int,
    run_command,
)
from ..errors import NanoinferError
from ..sampling import POOLING

# A served step that decodes lasts about this long (engine/pacing.py): prompt chunks are cut to
# fit, so every stream's next token comes within about this time of its last while prompts prefill.
# 50 ms: on a 2-core Xeon (AVX-512) llama-server's p99 inter-token latency at 8 streams is ~45 ms;
# at 100 ms ours was 100 ms (2.2x), at 50 ms 56 ms, for 4% less request throughput
# (docs/benchmarks.md, "Against llama-server").
STEP_TIME_TARGET_MS = 50.0


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_args(p)
    add_speculative_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: the model file's or folder's name)")
    acc = p.add_argument_group("access (docs/serving.md)")
    acc.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health and the page (repeat for "
                          "several keys; also NANOINFER_API_KEY, comma-separated)")
    acc.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                     help="web origins whose pages may call the API (CORS), e.g. http://localhost:3000; '*' for any "
                          "(default: none but the server's own page)")
    acc.add_argument("--allowed-hosts", action="append", default=None, metavar="HOST",
                     help="Host names answered besides the loopback ones when bound to a loopback address "
                          "(default: localhost, 127.0.0.1, [::1]); when bound elsewhere: the only ones answered")
    lim = p.add_argument_group("request limits")
    lim.add_argument("--max-n", type=positive_int, default=16, help="largest n (default 16)")
    lim.add_argument("--max-tokens-limit", type=positive_int, default=None,
                     help="largest max_tokens; also chat's default, and the cap of completions' 16 "
                          "(default: only the context window)")
    lim.add_argument("--max-prompts", type=positive_int, default=64,
                     help="most prompts in one /v1/completions request, or texts in one embeddings request "
                          "(default 64)")
    lim.add_argument("--max-request-bytes", type=byte_size, default=1 << 20,
                     help="largest request body; larger gets 413 (default 1M)")
    lim.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="seconds in-flight requests get to finish on SIGINT/SIGTERM; then they are aborted "
                          "(default 5)")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection gets to send a request's headers before it is closed (default 10)")
    lim.add_argument("--client-read-timeout", type=float, default=30.0,
                     help="seconds a stream may go unread: its request is paused once 64 chunks are waiting, and "
                          "aborted (KV freed, connection closed) after this long (default 30)")
    add_engine_args(p, max_num_seqs=64, max_num_batched_tokens=512, tensor_parallel=True,
                    step_time_target_ms=STEP_TIME_TARGET_MS)
    rep = p.add_argument_group("replicas (Ray Serve)")
    rep.add_argument("--replicas", type=positive_int, default=1,
                     help="serve N engine replicas behind this endpoint on Ray Serve (pip install 'nanoinfer[ray]')")
    rep.add_argument("--ray-address", default=None,
                     help="join this Ray cluster (default: start a local Ray instance)")
    rep.add_argument("--routing", default="prefix", choices=["prefix", "round-robin"],
                     help="how replicas are picked: prefix-aware (default) or round-robin")
    p.add_argument("--embedding-pooling", default="last", choices=POOLING,
                   help="how /v1/embeddings makes a text's vector of its final hidden states: the last position's "
                        "(default, as vLLM's decoder embedders) or the mean of all positions'; L2-normalised")
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
    if a.replicas > 1 or a.ray_address:
        return _serve_replicas(a)
    llm = LLM(a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              speculative_config=a.speculative_config, **engine_kwargs(a))
    lm = llm.loaded
    name = a.served_model_name or default_name(lm.path)
    access = access_policy(a)
    tools = "native" if llm.tokenizer.native_tools else "injected (the template does not list tools)"
    print(f"[{lm.path.name}: {lm.format}, {lm.config.architecture}, context {llm.max_model_len}, "
          f"{llm.engine.blocks.num_free} KV blocks, loaded in {lm.load_seconds:.1f}s; tool calling {tools}; "
          f"serving as {name!r} on http://{a.host}:{a.port}{' (API key required)' if access.api_keys else ''}]",
          file=sys.stderr, flush=True)
    config = ServerConfig(model_name=name, max_n=a.max_n, max_tokens_limit=a.max_tokens_limit,
                          max_request_bytes=a.max_request_bytes, max_prompts=a.max_prompts,
                          shutdown_timeout=a.shutdown_timeout, header_timeout=a.header_timeout,
                          client_read_timeout=a.client_read_timeout, access=access,
                          embedding_pooling=a.embedding_pooling)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again for the previous handler:
    # make that an ordinary exit (status 0) rather than death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(llm.engine, config, host=a.host, port=a.port, log_level=a.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        pass
    finally:
        llm.close()  # the other tensor-parallel ranks, if any
    return 0


def access_policy(a: argparse.Namespace):
    from .access import AccessPolicy
    return AccessPolicy.of(a.host, a.api_key, [o for v in a.allowed_origins or [] for o in v.split(",") if o],
                           [h for v in a.allowed_hosts or [] for h in v.split(",") if h])


def _serve_replicas(a: argparse.Namespace) -> int:
    from .replicas import ReplicaSettings, serve_replicas

    if a.tensor_parallel_size > 1:
        raise NanoinferError("--replicas with --tensor-parallel-size is not supported yet: pick one")
    if a.device != "cpu":
        raise NanoinferError("--replicas runs CPU replicas only: drop --device or --replicas")
    name = a.served_model_name or (default_name(Path(a.model)) if a.model else "SmolLM2-135M-Instruct.Q4_1")
    server = dict(model_name=name, max_n=a.max_n, max_tokens_limit=a.max_tokens_limit,
                  max_request_bytes=a.max_request_bytes, max_prompts=a.max_prompts,
                  shutdown_timeout=a.shutdown_timeout, header_timeout=a.header_timeout,
                  client_read_timeout=a.client_read_timeout, embedding_pooling=a.embedding_pooling)
    settings = ReplicaSettings(a.model and str(Path(a.model).resolve()), a.dtype, a.max_model_len, engine_kwargs(a),
                               server, a.replicas, a.speculative_config, access_policy(a),
                               threads=threads.share(a.threads, a.replicas))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve_replicas(settings, a.host, a.port, a.ray_address, a.routing)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = configure(argparse.ArgumentParser(prog="python -m nanoinfer.server",
                                          description="nanoinfer's OpenAI-compatible HTTP server"))
    p.set_defaults(func=cmd_serve)
    return run_command(p.parse_args(argv))
