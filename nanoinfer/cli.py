"""`nanoinfer` command line: generate, chat, tokenize; serve, bench, perplexity and eval come from
server/cli.py, bench/cli.py, bench/perplexity.py and evals/cli.py. The flags these share are defined in cli_args.py."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path

from .bench.cli import add_bench_parser
from .bench.perplexity import add_perplexity_parser
from .cli_args import add_model_arg, add_model_args, add_sampling_args, add_speculative_arg, run_command, sampling_params
from .errors import NanoinferError
from .evals.cli import add_eval_parser
from .kernels.quant_linear import parameter_count
from .server.cli import add_serve_parser


def add_parse_special_arg(p: argparse.ArgumentParser, default: bool | None, what: str) -> None:
    shown = {True: "on", False: "off", None: "on; off with --chat"}[default]
    p.add_argument("--parse-special", action=argparse.BooleanOptionalAction, default=default,
                   help=f"special-token text like <|im_start|> in {what} becomes the token (default: {shown})")


# How tool calls show in the terminal (nanochat models): the marker tokens are special,
# so they are kept in the text and drawn readably instead of being dropped.
TOOL_MARKERS = {"<|python_start|>": "[calculator: ", "<|python_end|>": "]", "<|output_start|>": " = ",
                "<|output_end|>": " "}


OTHER_SPECIAL = re.compile(r"<\|[A-Za-z_]{1,40}\|>")


def readable(text: str) -> str:
    for marker, shown in TOOL_MARKERS.items():
        text = text.replace(marker, shown)
    return OTHER_SPECIAL.sub("", text)  # any other special token is never printed raw


TOOL_CALL = re.compile(r"<\|python_start\|>(.*?)<\|python_end\|>(?:<\|output_start\|>(.*?)<\|output_end\|>)?", re.S)


def assistant_message(text: str) -> dict:
    """A reply for the history. Tool calls become nanochat's content parts, so the next
    turn renders them as tool tokens again rather than as typed text."""
    if "<|python_start|>" not in text:
        return {"role": "assistant", "content": text}
    parts, pos = [], 0
    for m in TOOL_CALL.finditer(text):
        if m.start() > pos:
            parts.append({"type": "text", "text": text[pos:m.start()]})
        parts.append({"type": "python", "text": m.group(1)})
        if m.group(2) is not None:
            parts.append({"type": "python_output", "text": m.group(2)})
        pos = m.end()
    if pos < len(text):
        parts.append({"type": "text", "text": text[pos:]})
    return {"role": "assistant", "content": parts}


def with_tool_markers(llm, params):
    """Models with tools keep their tool markers in the text (drawn by `readable`)."""
    from dataclasses import replace
    return replace(params, skip_special_tokens=False) if llm.engine.tools else params


def load_llm(a: argparse.Namespace):
    from .llm import LLM
    from .loaders import detect_format
    overrides = None
    if a.model and a.max_model_len and Path(a.model).exists() and detect_format(Path(a.model)) == "nanochat":
        # nanochat's windows let it slide past sequence_len (up to 10x): widen its rotary table
        overrides = {"max_position_embeddings": a.max_model_len}
    llm = LLM(a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, model_overrides=overrides,
              speculative_config=a.speculative_config, attention_backend=a.attention_backend)
    lm = llm.loaded
    formats = ", ".join(f"{n} {f}" for f, n in sorted(lm.info.get("tensor_formats", {}).items(), key=lambda x: -x[1]))
    print(f"[{lm.path.name}: {lm.format}, {lm.config.architecture}, {parameter_count(lm.model) / 1e6:.0f}M params"
          f"{f' (tensors: {formats})' if formats else ''}, context {llm.max_model_len}, "
          f"loaded in {lm.load_seconds:.1f}s]", file=sys.stderr)
    return llm


def format_stats(out) -> str:
    s = out.stats[0]
    c = out.outputs[0]
    d = s.as_dict()
    parts = [f"prompt {d['prompt_tokens']} tok", f"generated {d['generated_tokens']} tok",
             f"finish {c.finish_reason} ({c.finish_cause.value})"]
    if d["ttft_s"] is not None:
        parts.append(f"TTFT {d['ttft_s'] * 1000:.0f} ms")
    if d["mean_itl_s"] is not None:
        parts.append(f"ITL {d['mean_itl_s'] * 1000:.1f} ms")
    if d["decode_tok_per_s"] is not None:
        parts.append(f"{d['decode_tok_per_s']:.1f} tok/s")
    return "[" + ", ".join(parts) + "]"


def cmd_generate(a: argparse.Namespace) -> int:
    params = sampling_params(a)  # bad values fail before the model loads
    llm = load_llm(a)
    params = with_tool_markers(llm, params)
    parse_special = (not a.chat) if a.parse_special is None else a.parse_special
    if a.chat:
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
        stream = llm.stream_chat(messages, params, parse_special=parse_special)
    else:
        stream = llm.stream(a.prompt, params, parse_special=parse_special)
        if not a.no_echo:
            print(a.prompt, end="", flush=True)
    try:
        for delta in stream:
            print(readable(delta.text), end="", flush=True)
    except KeyboardInterrupt:
        stream.close()
        print("\n[stopped]", file=sys.stderr)
    print()
    if a.stats:
        print(format_stats(llm.last_output), file=sys.stderr)
    return 0


def fit_history(llm, history: list[dict], reserve: int, parse_special: bool = False) -> tuple[list[int], int]:
    """Drop the oldest user/assistant turns (a leading system message stays) until the
    rendered conversation leaves `reserve` tokens of room. Returns ids and turns dropped."""
    dropped = 0
    while True:
        ids = llm.chat_ids(history, parse_special=parse_special)
        if len(ids) + reserve <= llm.max_model_len:
            return ids, dropped
        first = 1 if history and history[0]["role"] == "system" else 0
        if len(history) - first <= 1:  # only the new user message is left
            raise NanoinferError(f"this message alone needs {len(ids)} tokens; the context window is "
                                 f"{llm.max_model_len} (with {reserve} reserved for the reply)")
        del history[first:first + 2]
        dropped += 1


def cmd_chat(a: argparse.Namespace) -> int:
    # Ctrl-C stops a reply even when the chat was started from a shell's background job,
    # which starts with SIGINT ignored (Python then keeps it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    params = sampling_params(a)
    llm = load_llm(a)
    params = with_tool_markers(llm, params)
    reserve = min(a.max_tokens or 256, llm.max_model_len // 2)
    system = [{"role": "system", "content": a.system}] if a.system else []
    history = list(system)
    print("nanoinfer chat: /clear resets the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/clear":
            history = list(system)
            print("[conversation cleared]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            ids, dropped = fit_history(llm, history, reserve, a.parse_special)
        except NanoinferError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"[context full: dropped the {dropped} oldest turn(s)]", file=sys.stderr)
        reply = []
        stream = llm.stream({"prompt_token_ids": ids}, params)
        try:
            for delta in stream:
                reply.append(delta.text)
                print(readable(delta.text), end="", flush=True)
        except KeyboardInterrupt:
            stream.close()
            print(" [stopped]", end="")
        print()
        history.append(assistant_message("".join(reply)))
        if a.stats:
            print(format_stats(llm.last_output), file=sys.stderr)


def cmd_tokenize(a: argparse.Namespace) -> int:
    from .loaders import load_tokenizer
    if a.file:
        try:
            text = Path(a.file).read_text(encoding="utf-8")
        except OSError as e:
            raise NanoinferError(f"{a.file}: {e.strerror}") from None
    elif a.text is not None:
        text = a.text
    else:
        raise NanoinferError("give TEXT or --file FILE")
    tok = load_tokenizer(a.model)
    ids = tok.encode(text, add_special_tokens=not a.no_special, parse_special=a.parse_special)
    print(json.dumps(ids))
    if a.show:
        print(json.dumps([tok.decode([i], skip_special_tokens=False) for i in ids], ensure_ascii=False),
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanoinfer", description="A small, readable LLM inference engine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt (raw text, or a chat message with --chat)")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT as a user message")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--stats", action="store_true", help="print TTFT, inter-token latency and tok/s")
    g.add_argument("--no-echo", action="store_true", help="raw mode: do not print the prompt first")
    add_parse_special_arg(g, None, "PROMPT")
    add_model_args(g)
    add_speculative_arg(g)
    add_sampling_args(g, max_tokens=256)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn chat in the terminal")
    c.add_argument("--system", default=None)
    c.add_argument("--stats", action="store_true")
    add_parse_special_arg(c, False, "your messages")
    add_model_args(c)
    add_speculative_arg(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("tokenize", help="print token ids as JSON")
    t.add_argument("text", nargs="?")
    t.add_argument("--file", "-f", default=None)
    add_model_arg(t)
    t.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    add_parse_special_arg(t, True, "TEXT")
    t.add_argument("--show", action="store_true", help="also print each token's text (stderr)")
    t.set_defaults(func=cmd_tokenize)

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_perplexity_parser(sub)
    add_eval_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from .distributed.executor import launched_by_torchrun, worker_from_torchrun
    if launched_by_torchrun() and int(os.environ["RANK"]) > 0:  # torchrun: every rank but 0 serves rank 0's steps
        return worker_from_torchrun()
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
