"""The generation loop on a tiny model: sampling, stop policy, batching, paged KV, prefix cache."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, InvalidRequestError, SamplingParams
from nanoinfer.reference import generate_uncached

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def rand_prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def alone(llm_dir, prompt, params, **kw) -> list[int]:
    return LLM(llm_dir, **kw).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids


# --- sampling ---------------------------------------------------------------------
def test_seeded_sampling_repeats_and_differs(llm):
    p = rand_prompt(10, 0)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
    b = llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
    c = llm.generate({"prompt_token_ids": p}, SamplingParams(**{**params.__dict__, "seed": 99}))[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_seed_independent_of_batch(llm):
    """A seeded request gives the same tokens alone and beside other requests."""
    p = rand_prompt(10, 1)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    solo = llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": rand_prompt(5 + i, 50 + i)} for i in range(3)]
    outs = llm.generate(others + [{"prompt_token_ids": p}], [SamplingParams(temperature=1.0, max_tokens=20)] * 3 + [params])
    assert outs[-1].outputs[0].token_ids == solo


def test_max_tokens_and_logprobs(llm):
    out = llm.generate({"prompt_token_ids": rand_prompt(8, 2)}, SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.finish_cause.value == "max_tokens"
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert len(lp) == 3
        assert all(v.logprob <= 0 for v in lp.values())
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))


def test_penalties_change_output(llm):
    p = {"prompt_token_ids": rand_prompt(6, 3)}
    base = llm.generate(p, SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0].token_ids
    pen = llm.generate(p, SamplingParams(max_tokens=30, frequency_penalty=2.0, presence_penalty=2.0,
                                         **GREEDY))[0].outputs[0].token_ids
    # with strong penalties no token repeats as often as in the greedy loop
    assert max(pen.count(t) for t in pen) <= max(base.count(t) for t in base)
    assert pen != base or len(set(base)) == len(base)


def test_min_tokens_suppresses_eos(llm):
    eos = next(iter(llm.tokenizer.eos_token_ids))
    p = {"prompt_token_ids": rand_prompt(6, 4)}
    out = llm.generate(p, SamplingParams(max_tokens=12, min_tokens=12, temperature=0,
                                         stop_token_ids=list(range(3, 300))))[0].outputs[0]
    assert len(out.token_ids) == 12  # every token is a stop token after min_tokens... but none before
    assert eos not in out.token_ids[:-1]


def test_stop_token_ids(llm):
    p = {"prompt_token_ids": rand_prompt(6, 5)}
    ref = llm.generate(p, SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0].token_ids
    stop_at = ref[7]
    out = llm.generate(p, SamplingParams(max_tokens=20, stop_token_ids=[stop_at], **GREEDY))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_across_tokens(llm):
    """A stop string that spans a token boundary ends generation; the text before it is kept."""
    p = {"prompt_token_ids": rand_prompt(6, 6)}
    ref = llm.generate(p, SamplingParams(max_tokens=30, skip_special_tokens=False, **GREEDY))[0].outputs[0]
    tok = llm.tokenizer
    pieces = [tok.decode(ref.token_ids[:i], skip_special_tokens=False) for i in range(len(ref.token_ids) + 1)]
    # a stop string made of the end of token 10's text and the start of token 11's
    b = len(pieces[10])
    stop = ref.text[b - 2:b + 2]
    assert len(stop) == 4 and pieces[9] != pieces[10]
    out = llm.generate(p, SamplingParams(max_tokens=30, stop=[stop], skip_special_tokens=False, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.finish_cause.value == "stop_string" and out.stop_reason == stop
    assert out.text == ref.text[:ref.text.index(stop)]
    assert stop not in out.text


def test_stream_deltas_add_up(llm):
    p = {"prompt_token_ids": rand_prompt(6, 7)}
    params = SamplingParams(max_tokens=25, **GREEDY)
    full = llm.generate(p, params)[0].outputs[0]
    deltas = list(llm.stream(p, params))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all("\ufffd" not in d.text for d in deltas) or "\ufffd" in full.text


def test_bad_requests(llm):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="context window"):
        llm.generate({"prompt_token_ids": [5] * llm.max_model_len}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 10**6]}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams())
    # nothing leaked, and the engine still works
    assert llm.engine.blocks.num_used == 0
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_context_full_finishes_with_length(llama_dir):
    llm = LLM(llama_dir, max_model_len=32)
    out = llm.generate({"prompt_token_ids": rand_prompt(20, 8)}, SamplingParams(max_tokens=None, **GREEDY))[0]
    c = out.outputs[0]
    assert len(out.prompt_token_ids) + len(c.token_ids) == 32
    assert c.finish_reason == "length" and c.finish_cause.value == "context_full"


# --- serving many -------------------------------------------------------------------
def test_batch_invariance_with_chunking_and_preemption(llama_dir):
    """Different prompt lengths, a budget small enough to chunk prefills, a pool small enough
    to preempt: every greedy output equals the same request run alone."""
    prompts = [rand_prompt(n, 100 + n) for n in (3, 40, 17, 70, 9, 33, 55, 5)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    model = LLM(llama_dir).loaded.model
    refs = [generate_uncached(model, p, 24)[0] for p in prompts]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # layers * k,v * block_size(4) * kv_heads * head_dim * fp32
    llm = LLM(llama_dir, block_size=4, kv_cache_memory=60 * block_bytes, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.blocks.num_used == 0


def test_paced_prefill_chunks_change_no_token(llama_dir):
    """A step-time target far below a step's cost: every prompt beside decodes advances by the
    pacer's minimum chunk; every greedy output still equals the request run alone."""
    prompts = [rand_prompt(n, 200 + n) for n in (50, 3, 61, 37)]
    model = LLM(llama_dir).loaded.model
    refs = [generate_uncached(model, p, 12)[0] for p in prompts]
    llm = LLM(llama_dir, max_num_batched_tokens=64, step_time_target_ms=1e-3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == refs
    pacer = llm.engine.scheduler.pacer
    assert pacer.seconds_per_token is not None
    chunks = [f.num_tokens for o in outs for s in o.stats for f in s.forwards if f.context_len > f.num_tokens > 1]
    assert chunks and all(n <= pacer.min_chunk for n in chunks)  # prefill continued beside decodes, paced
    with pytest.raises(InvalidRequestError):
        LLM(llama_dir, step_time_target_ms=-1.0)


def test_prefix_cache_computes_only_the_tail(llama_dir):
    llm = LLM(llama_dir, block_size=8)
    shared = rand_prompt(64, 9)
    a, b = shared + rand_prompt(5, 10), shared + rand_prompt(7, 11)
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm.generate({"prompt_token_ids": a}, params)
    out = llm.generate({"prompt_token_ids": b}, params)[0]
    prefilled = sum(f.num_tokens for f in out.stats[0].forwards) - (len(out.outputs[0].token_ids) - 1)
    assert prefilled == len(b) - 64  # the 8 shared blocks came from the cache
    assert llm.engine.blocks.stats.prefix_hits >= 64
    cold = alone(llama_dir, b, params, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == cold


def test_n_samples_share_the_prompt(llama_dir):
    bs = 8
    llm = LLM(llama_dir, block_size=bs)
    prompt = rand_prompt(45, 12)  # 5 full blocks + a partial one that every sample copies on write
    params = SamplingParams(n=16, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)
    rid = "n16"
    llm.engine.add_request(rid, prompt, params)
    llm.engine.step()  # the prefill; all 16 samples sample their first token from it
    llm.engine.step()  # one decode each: the partial block is copied per sample (copy on write)
    full_blocks, per_sample = 45 // bs, 1
    assert llm.engine.blocks.num_used == full_blocks + 16 * per_sample
    while llm.engine.has_unfinished():
        llm.engine.step()
    out = llm.engine.release(rid)
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(samples) == 16 and len(set(samples)) > 1
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    assert llm.engine.blocks.num_used == 0


def test_abort_mid_stream_frees_everything(llm):
    params = SamplingParams(max_tokens=50, n=3, temperature=1.0, ignore_eos=True)
    stream = llm.stream({"prompt_token_ids": rand_prompt(30, 13)}, params)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    assert llm.engine.blocks.num_used == 0
    assert not llm.engine.has_unfinished()
    assert llm.last_output.outputs[0].finish_reason == "abort"
