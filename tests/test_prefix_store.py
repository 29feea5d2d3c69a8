"""The persistent prefix cache (--prefix-cache-dir, engine/prefix_store.py): blocks written by one
engine are read back by the next on the same folder, giving the same tokens; files that are
corrupt, truncated or another configuration's are ignored with a log line; the size cap holds;
and a server restarted on the folder answers a long repeated system prompt much faster, with
the same answer."""
from __future__ import annotations

import logging
import time

import httpx2 as httpx
import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.prefix_store import SUFFIX

from server_utils import start_server

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, ids: list[int]):
    out = llm.generate({"prompt_token_ids": ids}, PARAMS)[0].outputs[0]
    return out.token_ids, [{k: v.logprob for k, v in d.items()} for d in out.logprobs]


def engine(path, folder, **kw) -> LLM:
    return LLM(path, dtype="auto", prefix_cache_dir=str(folder), **kw)


@pytest.fixture(scope="module")
def qwen3_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    from gguf_export import write_gguf_from_hf
    return write_gguf_from_hf(make_hf_model("qwen3")[0], tiny_tokenizer_dir,
                              tmp_path_factory.mktemp("pstore") / "qwen3.gguf", "Q8_0")


def test_a_second_engine_reads_the_first_ones_blocks(qwen3_gguf, tmp_path):
    ids = prompt(100)
    first = engine(qwen3_gguf, tmp_path)
    expected = run(first, ids)
    first.close()  # the writer finishes
    files = list(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == (100 + 12 - 1) // 16  # every full block: the prompt's and the reply's
    second = engine(qwen3_gguf, tmp_path)
    assert run(second, ids) == expected
    assert second.engine.metrics()["prefix_cache_disk_hits"] == (100 - 1) // 16 * 16
    # another KV format is another folder: nothing read from this one
    other = engine(qwen3_gguf, tmp_path, kv_cache_dtype="float32")
    run(other, ids)
    assert other.engine.metrics()["prefix_cache_disk_hits"] == 0
    other.close()  # its writer finishes: the files are counted after (counted before, a race)
    assert len({f.parent for f in tmp_path.rglob(f"*{SUFFIX}")}) == 2


def test_corrupt_truncated_and_foreign_files_are_ignored(qwen3_gguf, tmp_path, caplog):
    ids = prompt(100, 1)
    first = engine(qwen3_gguf, tmp_path)
    expected = run(first, ids)
    first.close()
    folder = next(tmp_path.iterdir())
    # the third block's file made corrupt: the chain stops there (blocks 1-2 read, the rest computed)
    probe = engine(qwen3_gguf, tmp_path)
    bs = probe.engine.scheduler.blocks.block_size
    from nanoinfer.engine.kv_manager import block_hash
    hashes, parent = [], None
    for i in range(6):
        parent = block_hash(parent, ids[i * bs:(i + 1) * bs])
        hashes.append(parent)
    third = folder / f"{hashes[2].hex()}{SUFFIX}"
    data = bytearray(third.read_bytes())
    data[-5] ^= 0xFF
    third.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="nanoinfer.engine"):
        assert run(probe, ids) == expected
    assert probe.engine.metrics()["prefix_cache_disk_hits"] == 2 * bs
    assert any("checksum" in r.getMessage() for r in caplog.records)
    # truncated, and another block's bytes under this name: ignored too
    fresh = engine(qwen3_gguf, tmp_path, enable_prefix_caching=True)
    (folder / f"{hashes[0].hex()}{SUFFIX}").write_bytes((folder / f"{hashes[0].hex()}{SUFFIX}").read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanoinfer.engine"):
        assert run(fresh, ids) == expected
    assert fresh.engine.metrics()["prefix_cache_disk_hits"] == 0
    assert any("truncated" in r.getMessage() or "bytes of payload" in r.getMessage() for r in caplog.records)
    fresh.close()
    swapped = engine(qwen3_gguf, tmp_path)
    (folder / f"{hashes[0].hex()}{SUFFIX}").write_bytes((folder / f"{hashes[1].hex()}{SUFFIX}").read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanoinfer.engine"):
        assert run(swapped, ids) == expected
    assert any("not the ones its name says" in r.getMessage() for r in caplog.records)


def test_the_size_cap_evicts_the_least_recently_used(qwen3_gguf, tmp_path):
    first = engine(qwen3_gguf, tmp_path)
    block = first.engine.disk_caches[0].block_bytes
    first.close()
    capped = engine(qwen3_gguf, tmp_path, prefix_cache_dir_bytes=5 * (block + 64))
    for seed in range(4):
        run(capped, prompt(64, 10 + seed))
    capped.engine.disk_caches[0].flush()
    assert len(list(tmp_path.rglob(f"*{SUFFIX}"))) <= 5
    assert capped.engine.disk_caches[0].stats["evicted"] > 0


def test_a_restarted_server_answers_a_long_system_prompt_from_disk(default_gguf, tmp_path):
    """Two server processes in turn on one folder: the second's first answer to a 2,000-token
    system prompt comes from the blocks the first wrote, much sooner, and is the same text."""
    system = " ".join(f"Rule {i}: answer politely and in full sentences." for i in range(200))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0}
    results = []
    for _ in range(2):
        s = start_server(["--model", str(default_gguf), "--prefix-cache-dir", str(tmp_path), "--kv-cache-memory",
                          "128M", "--log-level", "warning"])
        try:
            t0 = time.perf_counter()
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300)
            results.append((time.perf_counter() - t0, r.json()["choices"][0]["message"]["content"],
                            r.json()["usage"]["prompt_tokens"]))
        finally:
            s.stop()
    (cold, text, tokens), (warm, again, _) = results
    assert tokens >= 2000 and again == text
    assert warm < 0.5 * cold, (warm, cold)
