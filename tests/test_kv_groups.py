"""Sliding-window layers hold only their window (attention/kv_cache.py's KV groups,
engine/kv_manager.py's KVCacheManager): a windowed group's pool gives back the blocks its
window has slid past, so a long generation holds about window + chunk tokens there while
the full layers hold every token; the outputs are transformers' own; a cached prefix restores
the local layers from its window's blocks (in memory or on disk); and the pool's size rule
counts a windowed group at its window."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.attention.kv_cache import KVGroup, kv_groups
from nanoinfer.engine.kv_manager import NULL_BLOCK, GroupSpec, KVCacheManager
from nanoinfer.engine.memory import GroupCost, MemoryBudget, plan_kv_pool, sequence_bytes
from nanoinfer.engine.sequence import KVPlacement
from test_models import hf_greedy

from gguf_export import write_gguf_from_hf

WINDOW, BLOCK, CHUNK = 4, 4, 5  # the tiny Gemma 3's window (conftest), the block and step sizes used here


def test_layers_are_grouped_by_window():
    gemma3 = [WINDOW] * 5 + [None]
    assert kv_groups(gemma3, 256) == [KVGroup(None, (5,)), KVGroup(WINDOW, (0, 1, 2, 3, 4))]
    assert kv_groups([None, 4, None, 8], 256) == [KVGroup(None, (0, 2)), KVGroup(4, (1,)), KVGroup(8, (3,))]
    assert kv_groups([4096] * 3, 4096) == [KVGroup(None, (0, 1, 2))]  # a window the context fits in is no window
    assert kv_groups(gemma3, 256, by_window=False) == [KVGroup(None, tuple(range(6)))]


def test_a_windowed_group_gives_back_what_its_window_slid_past():
    m = KVCacheManager([GroupSpec(None, 64), GroupSpec(8, 16)], BLOCK)
    tokens = list(range(100, 140))
    kv = KVPlacement()
    assert m.allocate_prompt(kv, tokens) == 0
    held = []
    while kv.num_computed < len(tokens):
        n = min(CHUNK, len(tokens) - kv.num_computed)
        assert m.allocate_slots(kv, n)
        held.append(m.groups[1].num_used)
        kv.num_computed += n
        m.seal(kv, tokens)
    full, window = kv.block_tables
    assert len(full) == len(set(full)) == len(window) == 10  # the full group has no null block: its 0 is a block
    # at most the blocks overlapping the window behind the step's first query and its chunk
    assert max(held) <= -(-(8 - 1 + CHUNK) // BLOCK) + 1
    assert window[:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in window[7:]
    m.free(kv)
    assert m.num_used == 0
    # The prompt again: its slid-out window blocks stayed cached (named, never-used blocks taken
    # first), so every full block but the last token's is a hit in both groups.
    again = KVPlacement()
    assert m.allocate_prompt(again, tokens) == 36
    assert again.block_tables[1][:7] == [NULL_BLOCK] * 7  # the local layers restored from the window's blocks only
    m.free(again)
    # A window block gone (evicted): the hit is cut back to where the window's blocks remain.
    del m.groups[1].cached[_hashes(tokens)[7]]
    cut = KVPlacement()
    assert m.allocate_prompt(cut, tokens) == 28  # at 28 the window needs blocks 5 and 6, both there
    m.free(cut)


def _hashes(tokens: list[int]) -> list[bytes]:
    from nanoinfer.engine.kv_manager import block_hash
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        out.append(parent)
    return out


@pytest.fixture(scope="module")
def gemma3_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    return write_gguf_from_hf(make_hf_model("gemma3")[0], tiny_tokenizer_dir,
                              tmp_path_factory.mktemp("kvgroups") / "gemma3.gguf", "Q8_0")


def used_blocks_per_step(llm: LLM) -> list[list[int]]:
    """Each step's used blocks per KV group, recorded after the step was scheduled."""
    seen: list[list[int]] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def spy():
        batch = schedule()
        seen.append([g.num_used for g in scheduler.blocks.groups])
        return batch
    scheduler.schedule = spy
    return seen


def one_pool(monkeypatch) -> None:
    """Engines made from now on keep every layer in one pool (as before KV groups)."""
    from nanoinfer.engine import core
    grouped = core.kv_cache.kv_groups
    monkeypatch.setattr(core.kv_cache, "kv_groups", lambda windows, n, by_window=True: grouped(windows, n, False))


@pytest.mark.parametrize("weights", ["hf-fp32", "gguf-stack"])
def test_gemma3_holds_its_window_while_generating_past_it(make_hf_model, gemma3_gguf, weights, monkeypatch):
    """Prompt 12 + 40 generated tokens with a window of 4: the five local layers' pool holds at
    most the window's blocks, the global layer's grows with the sequence; the tokens are
    transformers' (fp32), and tokens and logprobs are those of one pool for all layers (the
    compiled stack on Q8_0 blocks)."""
    hf_model, folder = make_hf_model("gemma3")
    path = folder if weights == "hf-fp32" else gemma3_gguf
    dtype = "float32" if weights == "hf-fp32" else "auto"
    llm = LLM(path, dtype=dtype, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    engine = llm.engine
    assert [g.window for g in engine.kv_groups] == [None, WINDOW]
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    seen = used_blocks_per_step(llm)
    out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    full_used, window_used = zip(*seen)
    assert max(full_used) == -(-(12 + 40 - 1) // BLOCK)  # every token's block
    assert max(window_used) <= -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1 == 3
    if weights == "hf-fp32":
        assert out.token_ids == hf_greedy(hf_model, ids, 40)[0]
    else:
        assert llm.loaded.model.__dict__["_decoder_stack"][1] is not None, "the stack did not run"
        one_pool(monkeypatch)
        single = LLM(path, dtype=dtype, block_size=BLOCK, max_num_batched_tokens=CHUNK)
        assert len(single.engine.kv_groups) == 1
        ref = single.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
        assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
    # Alone, in a batch of three, and again from the prefix cache (the local layers' keys
    # restored from the window's blocks): the same tokens and logprobs.
    others = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 7)]
    batch = llm.generate([{"prompt_token_ids": p} for p in (ids, *others)], params)
    hits = engine.blocks.stats.prefix_hits
    assert hits >= (12 - 1) // BLOCK * BLOCK  # the first prompt's blocks, hit in both groups
    assert batch[0].outputs[0].token_ids == out.token_ids
    assert [d.keys() for d in batch[0].outputs[0].logprobs] == [d.keys() for d in out.logprobs]
    torch.testing.assert_close([[v.logprob for v in d.values()] for d in batch[0].outputs[0].logprobs],
                               [[v.logprob for v in d.values()] for d in out.logprobs], atol=0, rtol=0)
    assert engine.blocks.num_used == 0


def test_samples_and_preemption_under_windows(make_hf_model):
    """n=3 samples share the prompt's blocks in both groups; a pool with room for one sequence
    at the full window preempts and recomputes; every sample's tokens equal the roomy run's."""
    _, folder = make_hf_model("gemma3")
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=30, ignore_eos=True)
    roomy = LLM(folder, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK, max_model_len=48)
    expected = sorted(o.token_ids for o in roomy.generate({"prompt_token_ids": ids}, params)[0].outputs)
    per_layer_token = 2 * roomy.engine.cache.k[0][0, 0, 0].nbytes
    one_sequence = sequence_bytes([GroupCost(per_layer_token), GroupCost(5 * per_layer_token, WINDOW)], 48, BLOCK, CHUNK)
    tight = LLM(folder, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK, max_model_len=48,
                kv_cache_memory=one_sequence)
    assert [g.num_blocks for g in tight.engine.blocks.groups] == [12, 3]
    got = sorted(o.token_ids for o in tight.generate({"prompt_token_ids": ids}, params)[0].outputs)
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.blocks.num_used == 0


def test_the_disk_tier_restores_every_group(gemma3_gguf, tmp_path):
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)

    def engine():
        return LLM(gemma3_gguf, dtype="auto", block_size=BLOCK, prefix_cache_dir=str(tmp_path))
    first = engine()
    expected = first.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    first.close()
    assert len({f.parent for f in tmp_path.rglob("*.kvblock")}) == 2  # a folder per KV group
    second = engine()
    got = second.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs
    assert second.engine.metrics()["prefix_cache_disk_hits"] == (40 - 1) // BLOCK * BLOCK


def test_gemma3_kv_at_32k_costs_about_its_global_layers(make_hf_model, tmp_path):
    """A Gemma 3 layout (five local layers of window 1024 to one global) at a 32,768-token
    context: the default pool for one sequence is 1.24x what the global layer alone needs,
    where one pool for all layers needed 6x."""
    _, folder = make_hf_model("gemma3")
    big = tmp_path / "gemma3_32k"
    shutil.copytree(folder, big)
    config = json.loads((big / "config.json").read_text())
    config.update(max_position_embeddings=32768, sliding_window=1024)
    (big / "config.json").write_text(json.dumps(config))
    llm = LLM(big, dtype="float32", max_num_seqs=1)
    cache = llm.engine.cache
    pool = sum(t.nbytes for t in cache.k + cache.v)
    per_layer_token = 2 * cache.k[0][0, 0, 0].nbytes
    global_only = 1 * 32768 * per_layer_token
    assert llm.engine.max_model_len == 32768
    assert pool <= 1.25 * global_only
    costs = [GroupCost(per_layer_token), GroupCost(5 * per_layer_token, 1024)]
    budget = MemoryBudget(1 << 40, None, None)
    plan = plan_kv_pool(costs, 16, 32768, None, None, 1, budget, chunk=512)
    assert plan.num_blocks == [2048, -(-(1023 + 512) // 16) + 1 + 1]  # window + chunk, + the null block
    assert plan_kv_pool([GroupCost(6 * per_layer_token)], 16, 32768, None, None, 1, budget).num_blocks == [2048]
