"""One request cannot harm the others: values the API accepts are computed, values it cannot
serve are refused up front, and an error inside one request's sampling ends that request alone."""
from __future__ import annotations

import random

import pytest
import torch

from nanoinfer import LLM, InvalidRequestError, SamplingParams
from nanoinfer.errors import RequestFailedError
from nanoinfer.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS, RowSampler
from nanoinfer.tokenizer import StopMatcher

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def prompt(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}


def tokens(llm: LLM, p: dict, **params) -> list[int]:
    return llm.generate(p, SamplingParams(**params))[0].outputs[0].token_ids


def pool_is_empty(llm: LLM) -> bool:
    return not llm.engine.has_unfinished() and all(b.ref_count == 0 for g in llm.engine.blocks.groups for b in g.blocks)


# --- values the API accepts are computed ---------------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 1e-46, 5e-324])
def test_tiny_temperature_samples_the_argmax(llm, temperature):
    """logits / 1e-38 overflows float32; (logits - max) / T in float64 does not, and its
    distribution is the argmax's."""
    p = prompt(12, 1)
    greedy = tokens(llm, p, max_tokens=12, **GREEDY)
    assert tokens(llm, p, temperature=temperature, seed=3, max_tokens=12, ignore_eos=True) == greedy


def test_vanishing_repetition_penalty_samples(llm):
    """repetition_penalty 1e-38 pushes seen tokens with positive logits to +inf (float32) or
    5e38 (float64): sampling still works and, in the limit, picks a seen token."""
    p = prompt(12, 2)
    for penalty in (1e-38, 5e-324):
        out = llm.generate(p, SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=5, max_tokens=8,
                                             ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert pool_is_empty(llm)


def test_subnormal_values_are_accepted_or_named_exactly():
    assert SamplingParams(top_p=1e-310, repetition_penalty=1e-310).top_p == 1e-310
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty=-1e-310 ") as e:
        SamplingParams(repetition_penalty=-1e-310)
    assert e.value.param == "repetition_penalty"


# --- values it cannot serve are refused up front --------------------------------------
def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        llm.generate([prompt(5, 3), prompt(6, 4)],
                     [SamplingParams(max_tokens=4), SamplingParams(stop_token_ids=[10**12], min_tokens=1)])
    assert e.value.param == "stop_token_ids"
    assert not llm.engine.has_unfinished() and not llm.engine.requests  # the valid one was not started either


def test_a_ban_on_every_token_is_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="no token") as e:
        llm.generate(prompt(5, 3), SamplingParams(stop_token_ids=list(range(vocab)), min_tokens=1))
    assert e.value.param == "stop_token_ids"


def test_seed_outside_64_bits_is_refused():
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(seed=seed)
        assert e.value.param == "seed"
    SamplingParams(seed=2**64 - 1, n=3)  # the edges are accepted, forks wrap around


def test_seeded_forks_at_the_top_of_the_range(llm):
    out = llm.generate(prompt(6, 5), SamplingParams(n=3, seed=2**64 - 1, temperature=1.0, max_tokens=4))[0]
    assert len(out.outputs) == 3


def test_stop_strings_are_bounded():
    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)
    for stop in (["s"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_LENGTH + 1)]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(stop=stop)
        assert e.value.param == "stop"


def test_stop_matcher_partial_matches_agree_with_brute_force():
    """The held-back tail is the longest end of the text that starts a stop string."""
    def brute(buffer: str, stops: list[str]) -> int:
        return max((k for s in stops for k in range(1, min(len(s) - 1, len(buffer)) + 1)
                    if buffer.endswith(s[:k])), default=0)

    r = random.Random(0)
    for _ in range(5000):
        stops = ["".join(r.choice("ab") for _ in range(r.randint(1, 6))) for _ in range(r.randint(1, 3))]
        buffer = "".join(r.choice("abc") for _ in range(r.randint(0, 8)))
        assert StopMatcher(stops)._longest_partial(buffer) == brute(buffer, stops), (buffer, stops)


def test_forks_count_against_max_num_seqs(llama_dir):
    llm = LLM(llama_dir, max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt(5, 0), SamplingParams(n=5))
    assert e.value.param == "n"
    engine = llm.engine
    for i in range(3):
        engine.add_request(str(i), prompt(6 + i, i)["prompt_token_ids"],
                           SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=6, ignore_eos=True))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most <= 4
    assert all(len(engine.release(str(i)).outputs[0].token_ids) == 6 for i in range(3))


# --- an error inside one request ends that request alone ------------------------------
@pytest.fixture
def failing_seed(monkeypatch):
    """Sampling raises for rows seeded 13: a stand-in for any bug in one request's processing."""
    commit = RowSampler.commit

    def faulty(self, token, generator_state=None):
        if self.params.seed == 13 and self.num_generated == 2:
            raise ArithmeticError("injected")
        return commit(self, token, generator_state)

    monkeypatch.setattr(RowSampler, "commit", faulty)
    return 13


def test_failing_request_ends_alone_in_the_engine(llama_dir, failing_seed):
    llm = LLM(llama_dir)
    engine = llm.engine
    good = [prompt(5 + i, 10 + i) for i in range(8)]
    alone = [tokens(llm, p, max_tokens=10, **GREEDY) for p in good]
    for i, p in enumerate(good):
        engine.add_request(f"good-{i}", p["prompt_token_ids"], SamplingParams(max_tokens=10, **GREEDY))
    engine.add_request("bad", prompt(7, 99)["prompt_token_ids"],
                       SamplingParams(n=2, temperature=1.0, seed=failing_seed, max_tokens=10))
    failures: dict = {}
    while engine.has_unfinished():
        deltas = engine.step()
        assert all(d.request_id != "bad" for d in deltas if d.token_ids and len(failures))
        failures |= engine.take_failures()
    assert list(failures) == ["bad"] and isinstance(failures["bad"], RequestFailedError)
    assert "ArithmeticError: injected" in str(failures["bad"])
    assert [engine.release(f"good-{i}").outputs[0].token_ids for i in range(8)] == alone
    engine.release("bad")
    assert pool_is_empty(llm)


def test_failing_request_raises_from_llm_generate(llama_dir, failing_seed):
    llm = LLM(llama_dir)
    with pytest.raises(RequestFailedError, match="injected"):
        llm.generate([prompt(5, 1), prompt(6, 2)],
                     [SamplingParams(max_tokens=6, **GREEDY), SamplingParams(temperature=1.0, seed=failing_seed)])
    assert not llm.engine.requests and pool_is_empty(llm)
    assert len(tokens(llm, prompt(5, 1), max_tokens=6, **GREEDY)) == 6  # the engine goes on
    with pytest.raises(RequestFailedError):
        list(llm.stream(prompt(5, 1), SamplingParams(temperature=1.0, seed=failing_seed, max_tokens=6)))


# --- the same through the server: one 500, eight normal answers, /health 200 ----------
def test_failing_request_ends_alone_in_the_server(llama_dir, failing_seed):
    """A real engine thread and real sampling; only the seeded row's sampler raises. Eight
    concurrent requests (streamed and not) finish normally with the tokens they get alone,
    the failing one gets a 500 (an error event then [DONE] when streamed), /health stays 200
    throughout, and the KV pool ends empty."""
    import concurrent.futures
    import json

    import httpx2 as httpx
    import openai

    from nanoinfer.server import ServerConfig, create_app

    from server_utils import serve_in_thread

    llm = LLM(llama_dir)
    good = [[3 + i, 40 + i, 7, 99 + i, 12] for i in range(8)]
    alone = [tokens(llm, {"prompt_token_ids": p}, max_tokens=24, **GREEDY) for p in good]
    app = create_app(llm.engine, ServerConfig(model_name="m"))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

        def normal(i: int) -> str:
            kw = dict(model="m", prompt=good[i], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            if i % 2:
                chunks = list(client.completions.create(stream=True, **kw))
                assert chunks[-1].choices[0].finish_reason == "length"
                return "".join(c.choices[0].text for c in chunks if c.choices)
            r = client.completions.create(**kw)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24
            return r.choices[0].text

        def failing() -> None:
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="m", prompt=good[0], max_tokens=24, seed=failing_seed)
            assert e.value.body["type"] == "server_error" and "injected" in e.value.body["message"]
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "prompt": good[1], "max_tokens": 24, "seed": failing_seed, "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "server_error"

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(normal, i) for i in range(8)] + [pool.submit(failing)]
            while not all(f.done() for f in futures):
                assert httpx.get(f"{url}/health", timeout=10).status_code == 200
                concurrent.futures.wait(futures, timeout=0.2)
            texts = [f.result() for f in futures[:8]]
            futures[8].result()
        assert texts == [llm.tokenizer.decode(a) for a in alone]
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        assert pool_is_empty(llm)


def test_default_kv_pool_follows_the_model_and_the_machine(llama_dir):
    from nanoinfer.engine.memory import GroupCost, MemoryBudget, default_kv_pool_bytes, plan_kv_pool

    per_token, context = 1000, 2048
    one = [GroupCost(per_token)]
    assert default_kv_pool_bytes(one, context, 64, 1 << 40) == per_token * context * 64  # all fit
    assert default_kv_pool_bytes(one, context, 64, 25 << 20) == 25 << 20  # the limit
    # a context that is not a whole number of blocks gets its last block whole: it fits (it was refused)
    assert default_kv_pool_bytes(one, 948, 1, 1 << 40, block_size=16) == per_token * 960
    assert plan_kv_pool(one, 16, 2048, 948, None, 1, MemoryBudget(100 << 30, None, None)).max_model_len == 948
    assert MemoryBudget(100 << 30, None, None).pool_limit() == 25 << 30  # a quarter of what is free
    assert MemoryBudget(100 << 30, 8 << 30, None).pool_limit() == 2 << 30  # ... of the cgroup's headroom
    assert MemoryBudget(100 << 30, None, 5 << 30).pool_limit() == 2 << 30  # half the address space after 1 GiB
    assert MemoryBudget(100 << 30, None, None).pool_limit(share=0.25) == 25 << 28  # a replica's share
    llm = LLM(llama_dir)
    engine = llm.engine
    assert engine.max_model_len == engine.model_config.max_position_embeddings
    assert engine.blocks.groups[0].num_free * engine.config.block_size >= engine.max_model_len


def test_kv_pool_pages_cost_nothing_until_used():
    import resource

    from nanoinfer.attention import PagedKVCache
    from nanoinfer.attention.kv_cache import kv_groups

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cache = PagedKVCache.allocate(kv_groups([None] * 24, 8192), [8192], 16, 4, 64, torch.float32, "cpu")  # 2 x 3 GiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    assert float(cache.k[0][:, 100].abs().sum()) == 0.0 and cache.k[0].is_contiguous()


def test_a_sampler_error_stays_with_its_row(llama_dir, monkeypatch):
    """The batched sampler raising for one row (a stand-in for a bug): the batch is sampled again
    row by row, that request ends with the error, and the others get the tokens they get alone."""
    import nanoinfer.engine.core as core

    llm = LLM(llama_dir)
    good = [prompt(5 + i, 10 + i) for i in range(4)]
    alone = [tokens(llm, p, max_tokens=8, **GREEDY) for p in good]
    real = core.sample_rows

    def faulty(logits, jobs):
        if any(j.sampler.params.seed == 13 for j in jobs):
            raise ArithmeticError("injected")
        return real(logits, jobs)

    monkeypatch.setattr(core, "sample_rows", faulty)
    engine = llm.engine
    for i, p in enumerate(good):
        engine.add_request(f"good-{i}", p["prompt_token_ids"], SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("bad", prompt(7, 99)["prompt_token_ids"], SamplingParams(temperature=1.0, seed=13, max_tokens=8))
    failures: dict = {}
    while engine.has_unfinished():
        engine.step()
        failures |= engine.take_failures()
    assert list(failures) == ["bad"] and "injected" in str(failures["bad"])
    assert [engine.release(f"good-{i}").outputs[0].token_ids for i in range(4)] == alone
