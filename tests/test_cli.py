"""The `nanoinfer` command: generate, chat, tokenize, and its errors."""
from __future__ import annotations

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
    p = _chat_proc(str(long_reply_model), "-n", "60000", "--ignore-eos")
    p.stdin.write("Tell me everything\n")
    p.stdin.flush()
    deadline = time.time() + 60
    seen = ""
    while len(seen) < 20 and time.time() < deadline:
        seen += p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    p.stdin.write("/exit\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    assert "[stopped]" in seen + out


def test_assistant_message_parts():
    text = "Sure <|python_start|>2+3<|python_end|><|output_start|>5<|output_end|> done"
    assert assistant_message(text)["content"] == [
        {"type": "text", "text": "Sure "}, {"type": "python", "text": "2+3"},
        {"type": "python_output", "text": "5"}, {"type": "text", "text": " done"}]
    assert assistant_message("plain")["content"] == "plain"
