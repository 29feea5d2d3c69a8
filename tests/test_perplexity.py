"""`nanoinfer perplexity`: llama.cpp's protocol (chunks of CTX, each alone, scored on the second
half, BOS in place of the first token where the model adds one), checked against transformers."""
from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from nanoinfer.bench.perplexity import perplexity, read_text
from nanoinfer.cli import main

CTX = 32

TEXT = "\n".join([
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "The quick brown fox jumps over the lazy dog; the dog, unimpressed, goes back to sleep.",
    "Numbers such as 3.14159 and 2.71828 turn up in the most unexpected places.",
    "def add(a, b):\n    return a + b",
    "Hello, world! How are you today? I'm fine, thanks, and you?",
    "Café, naïve, résumé: some words keep their accents in English.",
    "A river runs through the valley, past the mill and under the old stone bridge.",
]) * 3 + "\n"  # one trailing newline, which llama.cpp's -f drops


def write(tmp_path, text: str, name: str = "text.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def run_json(capsys, *argv: str) -> tuple[dict, str]:
    assert main(["perplexity", *argv, "--json", "--no-progress"]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def reference_ppl(folder, text: str, ctx: int, max_chunks: int | None = None) -> tuple[float, int, int]:
    """The protocol by hand on transformers: its tokenizer (add_special_tokens as the model
    says), its model's logits per chunk, log-softmax in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=True)["input_ids"]
    add_bos = ids[:1] == [tok.bos_token_id] and tok(text, add_special_tokens=False)["input_ids"][:1] != ids[:1]
    n_chunks = len(ids) // ctx if max_chunks is None else min(len(ids) // ctx, max_chunks)
    first = ctx // 2
    nlls = []
    for c in range(n_chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if add_bos:
            chunk[0] = tok.bos_token_id
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        nlls += [-float(logprobs[i, chunk[i + 1]]) for i in range(first, ctx - 1)]
    return math.exp(sum(nlls) / len(nlls)), len(nlls), len(ids)


def test_ppl_matches_transformers(llama_dir, tmp_path, capsys):
    doc, out = run_json(capsys, write(tmp_path, TEXT), "--model", str(llama_dir), "--ctx", str(CTX))
    ref_ppl, scored, num_tokens = reference_ppl(llama_dir, TEXT[:-1], CTX)
    assert doc["ppl"] == pytest.approx(ref_ppl, rel=1e-4)
    assert doc["add_bos"] is False  # the tiny tokenizer adds no BOS
    assert doc["num_tokens"] == num_tokens and doc["ctx"] == CTX
    assert doc["chunks"] == num_tokens // CTX >= 3
    assert doc["tokens_scored"] == scored == doc["chunks"] * (CTX - CTX // 2 - 1)
    assert doc["model"] == str(llama_dir) and doc["dtype"] == "auto" and doc["seconds"] >= 0
    assert math.exp(doc["nll"]) == pytest.approx(doc["ppl"])
    # llama.cpp's lines: the running figure after each chunk, then the final estimate
    lines = out.splitlines()
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},)+", lines[-3])
    assert lines[-3].count("[") == doc["chunks"] and lines[-3].endswith(f"[{doc['chunks']}]{doc['ppl']:.4f},")
    assert lines[-2].startswith(f"Final estimate: PPL = {doc['ppl']:.4f} +/- ")


def test_bos_replaces_each_chunks_first_token(llama_dir, tmp_path, capsys):
    """A tokenizer that adds BOS (a llama-style post-processor): the text starts with BOS and
    every chunk's first token is replaced by it, as llama-perplexity does."""
    folder = tmp_path / "bos_model"
    shutil.copytree(llama_dir, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    bos_id = data["model"]["vocab"].get(bos) or next(t["id"] for t in data["added_tokens"] if t["content"] == bos)
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    path = write(tmp_path, TEXT)

    with_bos, _ = run_json(capsys, path, "--model", str(folder), "--ctx", str(CTX))
    without, _ = run_json(capsys, path, "--model", str(llama_dir), "--ctx", str(CTX))
    ref_ppl, scored, num_tokens = reference_ppl(folder, TEXT[:-1], CTX)
    assert with_bos["add_bos"] is True
    assert with_bos["num_tokens"] == num_tokens == without["num_tokens"] + 1
    assert with_bos["tokens_scored"] == scored
    assert with_bos["ppl"] == pytest.approx(ref_ppl, rel=1e-4)
    assert with_bos["ppl"] != pytest.approx(without["ppl"], rel=1e-4)


class UniformScorer:
    """A scorer of equal probabilities over `vocab` tokens (ppl is exactly `vocab`); records the chunks."""

    def __init__(self, vocab: int):
        self.vocab, self.seen = vocab, []

    def __call__(self, chunk: list[int]) -> torch.Tensor:
        self.seen.append(list(chunk))
        return torch.full((len(chunk) - len(chunk) // 2 - 1,), math.log(self.vocab), dtype=torch.float64)


def test_protocol_chunks_bos_and_scored_rows():
    ids = list(range(10, 10 + 8 * 3 + 5))  # three chunks of 8 and a tail of 5, dropped
    score = UniformScorer(50)
    r = perplexity(score, ids, 8, bos=1)
    assert r.ppl == pytest.approx(50) and r.chunks == 3 and r.tokens_scored == 3 * 3 and r.num_tokens == len(ids)
    assert score.seen == [[1, *ids[c * 8 + 1:(c + 1) * 8]] for c in range(3)]
    assert ids[:2] == [10, 11]  # the caller's ids are left alone
    score = UniformScorer(50)
    perplexity(score, ids, 7, bos=None, max_chunks=2)
    assert score.seen == [ids[:7], ids[7:14]]


def test_the_engine_scores_the_second_half(llama_dir):
    """engine_scorer: a chunk's tokens first+1 .. ctx-1 (first = ctx // 2), each given the
    tokens before it, through the engine's cache: the uncached forward's log-softmax, and a
    bf16 cache moves the figures as it moves generation."""
    from nanoinfer import LLM
    from nanoinfer.bench.perplexity import engine_scorer
    from nanoinfer.reference import prompt_logprobs_uncached

    chunk = list(range(40, 40 + 17))  # odd ctx: first = 8, tokens 9 .. 16
    llm = LLM(llama_dir, dtype="float32", max_model_len=17, enable_prefix_caching=False)  # a full window: scoring
    nll = engine_scorer(llm)(chunk)
    reference = prompt_logprobs_uncached(llm.loaded.model, chunk)
    assert nll.shape == (8,)
    torch.testing.assert_close(nll, -torch.tensor(reference[8:], dtype=torch.float64), rtol=1e-5, atol=1e-5)
    bf16 = engine_scorer(LLM(llama_dir, dtype="float32", max_model_len=17, kv_cache_dtype="bfloat16",
                             enable_prefix_caching=False))(chunk)
    assert not torch.equal(bf16, nll)
    rounded = prompt_logprobs_uncached(llm.loaded.model, chunk, kv_dtype=torch.bfloat16)
    torch.testing.assert_close(bf16, -torch.tensor(rounded[8:], dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_chunks_limits_the_run(llama_dir, tmp_path, capsys):
    path = write(tmp_path, TEXT)
    full, _ = run_json(capsys, path, "--model", str(llama_dir), "--ctx", str(CTX))
    two, out = run_json(capsys, path, "--model", str(llama_dir), "--ctx", str(CTX), "--chunks", "2")
    assert two["chunks"] == 2 and two["tokens_scored"] == 2 * (CTX - CTX // 2 - 1)
    assert two["num_tokens"] == full["num_tokens"]
    assert two["running_ppl"] == full["running_ppl"][:2] and two["ppl"] == pytest.approx(full["running_ppl"][1])
    assert out.splitlines()[-3].count("[") == 2
    assert main(["perplexity", path, "--model", str(llama_dir), "--ctx", str(CTX), "--chunks", "999", "--json",
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["chunks"] == full["chunks"]


@pytest.mark.parametrize("argv, message", [
    (["--ctx", "256"], r"error: the text tokenizes to only \d+ tokens; perplexity with --ctx 256 needs at least 512"),
    (["--ctx", "2"], "error: --ctx must be at least 3"),
    (["--ctx", "4096"], r"error: --ctx 4096 is longer than the model's context window \(256\)"),
])
def test_errors_are_one_line(llama_dir, tmp_path, capsys, argv, message):
    text = TEXT if argv[1] != "256" else TEXT[:300]
    assert main(["perplexity", write(tmp_path, text), "--model", str(llama_dir), *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) <= 2  # the load line, then the error
    assert re.match(message, err.strip().splitlines()[-1])


def test_missing_or_binary_file(tmp_path, capsys):
    assert main(["perplexity", str(tmp_path / "nope.txt")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xff\xfe")
    assert main(["perplexity", str(bad)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


def test_read_text_as_llama_cpp(tmp_path):
    """Bytes as they are (CRLF kept), one trailing newline dropped."""
    assert read_text(write(tmp_path, "a\r\nb\n\n")) == "a\r\nb\n"
    assert read_text(write(tmp_path, "a")) == "a"
