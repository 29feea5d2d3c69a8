"""The `nanoinfer` command: generate, chat, tokenize, and its errors."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.cli import assistant_message, main


@pytest.fixture(scope="module")
def model_dir(make_hf_model):
    return str(make_hf_model("llama")[1])


def test_generate_greedy_matches_api(model_dir, capsys):
    assert main(["generate", "Hello world", "--model", model_dir, "-t", "0", "-n", "12", "--ignore-eos",
                 "--no-echo", "--stats"]) == 0
    out, err = capsys.readouterr()
    expected = LLM(model_dir).generate("Hello world", SamplingParams(temperature=0, max_tokens=12,
                                                                     ignore_eos=True))[0].outputs[0].text
    assert out == expected + "\n"
    assert "generated 12 tok" in err and "tok/s" in err and "TTFT" in err


def test_generate_chat(model_dir, capsys):
    assert main(["generate", "Hi", "--chat", "--model", model_dir, "-t", "0", "-n", "5"]) == 0
    out, _ = capsys.readouterr()
    llm = LLM(model_dir)
    expected = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=5))
    assert out == expected[0].outputs[0].text + "\n"


def test_tokenize(model_dir, capsys, tmp_path):
    assert main(["tokenize", "Hello <|im_start|> world", "--model", model_dir]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids == LLM(model_dir).tokenizer.encode("Hello <|im_start|> world", parse_special=True)
    f = tmp_path / "t.txt"
    f.write_text("Café 日本\n")
    assert main(["tokenize", "--file", str(f), "--model", model_dir]) == 0
    assert json.loads(capsys.readouterr().out) == LLM(model_dir).tokenizer.encode("Café 日本\n")


def test_raw_prompts_parse_special_tokens(model_dir, capsys):
    """`generate` parses special tokens written in a raw prompt (--no-parse-special: plain text);
    with --chat the message stays text unless --parse-special. Before: always plain text."""
    tok = LLM(model_dir).tokenizer
    raw = "<|im_start|>user\nHi"
    chat = [{"role": "user", "content": raw}]

    def prompt_tokens(*argv: str) -> int:
        assert main(["generate", raw, "--model", model_dir, "-t", "0", "-n", "1", "--no-echo", "--stats",
                     *argv]) == 0
        return int(re.search(r"prompt (\d+) tok", capsys.readouterr().err).group(1))

    assert prompt_tokens() == len(tok.encode(raw, parse_special=True))
    assert prompt_tokens("--no-parse-special") == len(tok.encode(raw))
    assert prompt_tokens("--chat") == len(tok.encode_chat(chat))
    assert prompt_tokens("--chat", "--parse-special") == len(tok.encode_chat(chat, parse_special=True))
    assert len(tok.encode_chat(chat, parse_special=True)) < len(tok.encode_chat(chat))
    assert main(["tokenize", raw, "--model", model_dir]) == 0
    assert json.loads(capsys.readouterr().out) == tok.encode(raw, parse_special=True)
    assert main(["tokenize", raw, "--model", model_dir, "--no-parse-special"]) == 0
    assert json.loads(capsys.readouterr().out) == tok.encode(raw)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "x", "--model", "/nonexistent/model.gguf"], "no such file"),
    (["generate", "x", "--temperature", "-3"], "temperature"),
    (["tokenize", "--file", "/nonexistent.txt"], "/nonexistent.txt"),
])
def test_errors_are_one_line(argv, needle, capsys, model_dir):
    if "--model" not in argv and argv[0] == "generate":
        argv = argv + ["--model", model_dir]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err


def test_corrupt_model_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert main(["generate", "x", "--model", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err


def _chat_proc(model_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "nanoinfer.cli", "chat", "--model", model_dir, "-t", "0", *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)


def test_chat_repl_drops_old_turns_and_clears(model_dir):
    # a context of 64 tokens holds about one exchange: the second message pushes the first out
    p = _chat_proc(model_dir, "--max-model-len", "64", "-n", "8")
    out, err = p.communicate("Hello there friend\nAnd another message\n/clear\nHi\n/exit\n", timeout=120)
    assert p.returncode == 0
    assert "dropped the 1 oldest turn" in err
    assert "[conversation cleared]" in err
    assert out.count("> ") >= 4


def test_chat_ctrl_c_stops_the_reply_not_the_session(long_reply_model):
    # a reply of a minute or more: Ctrl-C lands mid-reply however fast the engine is
    import threading

    p = _chat_proc(str(long_reply_model), "-n", "60000", "--ignore-eos")
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: p.stdout.read(1), "")), daemon=True)
    reader.start()
    p.stdin.write("Tell me everything\n")
    p.stdin.flush()
    deadline = time.time() + 60
    while len(seen) < 20 and time.time() < deadline:
        time.sleep(0.05)
    # Ctrl-C as a user presses it: again if the reply has not stopped after a few seconds
    for _ in range(5):
        p.send_signal(signal.SIGINT)
        until = time.time() + 5
        while "[stopped]" not in "".join(seen) and time.time() < until:
            time.sleep(0.05)
        if "[stopped]" in "".join(seen):
            break
    p.stdin.write("/exit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0
    reader.join(10)
    assert "[stopped]" in "".join(seen)


def test_assistant_message_parts():
    text = "Sure <|python_start|>2+3<|python_end|><|output_start|>5<|output_end|> done"
    assert assistant_message(text)["content"] == [
        {"type": "text", "text": "Sure "}, {"type": "python", "text": "2+3"},
        {"type": "python_output", "text": "5"}, {"type": "text", "text": " done"}]
    assert assistant_message("plain")["content"] == "plain"


# --- the parsers: no import cycle, shared flags defined once ------------------------------
def test_bench_and_server_never_import_the_top_level_cli():
    """Layers: nanoinfer.cli -> server.cli, bench.cli -> cli_args. Lazy imports inside
    functions count too (bench's `main` once called nanoinfer.cli's), so read every import."""
    import ast
    from pathlib import Path

    import nanoinfer
    root = Path(nanoinfer.__file__).parent
    for pkg, other in (("bench", "server"), ("server", "bench")):
        for path in (root / pkg).rglob("*.py"):
            package = ["nanoinfer", *path.relative_to(root).parent.parts]
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom):
                    base = package[:len(package) - node.level + 1] if node.level else []
                    mod = ".".join(base + ([node.module] if node.module else []))
                    names = [mod] + [f"{mod}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    for banned in ("nanoinfer.cli", f"nanoinfer.{other}"):
                        assert name != banned and not name.startswith(banned + "."), f"{path.name} imports {name}"


def test_bench_main_runs_without_the_top_level_cli():
    code = ("import sys; from nanoinfer.bench.cli import main; import nanoinfer.server.cli; "
            "rc = main(['latency', '--batch-sizes', 'x']); "
            "assert rc == 1 and 'nanoinfer.cli' not in sys.modules, (rc, sorted(sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: --batch-sizes")


def test_shared_flags_parse_the_same_everywhere():
    from nanoinfer.bench.cli import _add_commands
    from nanoinfer.cli import build_parser
    from nanoinfer.cli_args import sampling_params

    p = build_parser()
    bench_alone = argparse.ArgumentParser()  # `python -m nanoinfer.bench`'s parser
    _add_commands(bench_alone.add_subparsers(dest="bench_command", required=True))

    def parse(cmd: list[str], *flags: str) -> argparse.Namespace:
        return p.parse_args(cmd + list(flags))

    loading = [["generate", "x"], ["chat"], ["serve"], ["bench", "latency"], ["bench", "throughput"],
               ["bench", "loop"]]
    for cmd in loading + [["tokenize", "x"]]:
        assert parse(cmd, "-m", "m.gguf").model == "m.gguf"
    for cmd in loading:
        assert parse(cmd, "--dtype", "bf16").dtype == "bf16"
        if cmd[0] == "bench":
            a = bench_alone.parse_args(cmd[1:] + ["--model", "m.gguf", "--dtype", "bf16"])
            assert (a.model, a.dtype) == ("m.gguf", "bf16")
    for cmd in (["generate", "x"], ["chat"], ["serve"]):
        assert parse(cmd, "--max-model-len", "64").max_model_len == 64
        with pytest.raises(SystemExit):
            parse(cmd, "--max-model-len", "0")
    sampling = ["-t", "0.5", "--top-p", "0.9", "--top-k", "7", "--min-p", "0.1", "--repetition-penalty", "1.1",
                "--presence-penalty", "0.2", "--frequency-penalty", "0.3", "--seed", "5", "--stop", "a",
                "--stop", "b", "--ignore-eos", "-n", "9"]
    assert sampling_params(parse(["generate", "x"], *sampling)) == sampling_params(parse(["chat"], *sampling)) \
        == SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, repetition_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.3, seed=5, stop=["a", "b"],
                          ignore_eos=True, max_tokens=9)
    engine = ["--max-num-seqs", "3", "--max-num-batched-tokens", "256"]
    for cmd in (["serve"], ["bench", "throughput"]):
        a = parse(cmd, *engine)
        assert (a.max_num_seqs, a.max_num_batched_tokens) == (3, 256)

    # each command keeps its own defaults
    gen, chat, serve = parse(["generate", "x"]), parse(["chat"]), parse(["serve"])
    lat, thr = parse(["bench", "latency"]), parse(["bench", "throughput"])
    assert (gen.dtype, serve.dtype, lat.dtype, thr.dtype) == ("auto", "auto", None, None)
    assert (gen.max_tokens, chat.max_tokens, gen.temperature, gen.seed, lat.seed) == (256, 512, 0.8, None, 0)
    # kv_cache_memory None: the pool follows the model and the machine
    assert (serve.max_num_seqs, serve.max_num_batched_tokens, serve.kv_cache_memory) == (64, 512, None)
    assert (thr.max_num_seqs, thr.max_num_batched_tokens) == (None, None)  # sized per device later
    # a served step that decodes is paced; offline runs take the token budget alone
    assert (serve.step_time_target_ms, thr.step_time_target_ms) == (50.0, None)
    assert parse(["serve"], "--step-time-target-ms", "0").step_time_target_ms is None
    assert parse(["bench", "throughput"], "--step-time-target-ms", "40").step_time_target_ms == 40.0
    for bad in ("-5", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            parse(["serve"], "--step-time-target-ms", bad)
    assert parse(["generate", "x"], "-n", "4").max_tokens == 4  # -n is each command's own
    assert parse(["bench", "throughput"], "-n", "4").num_requests == 4


def test_a_first_kernel_build_says_so(tmp_path, monkeypatch, capsys):
    """The first run on a machine builds the CPU kernels (tens of seconds): a line says so before
    the wait, not after. A compiler that fails at once shows both lines without the wait."""
    from nanoinfer.kernels import cpu_kernels

    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\necho 'no' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.library.__wrapped__() is None  # the cached library of this process is untouched
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("nanoinfer: building the CPU kernels for this machine (once; cached in")
    assert "building the CPU kernels failed" in lines[1]
