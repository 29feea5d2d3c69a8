"""Embeddings (SamplingParams.pooling, LLM.embed, POST /v1/embeddings): a prompt's final
normalised hidden states pooled (last position or mean) and L2-normalised, computed by the
engine's scheduler like any prefill. Checked against transformers' own hidden states, for
batch invariance (alone, in a batch of 16, chunked, beside generating rows, after a prefix-cache
hit), and through the official `openai` client against a real server."""
from __future__ import annotations

import base64
import math

import numpy as np
import openai
import pytest
import torch

from nanoinfer import LLM, InvalidRequestError, SamplingParams

from server_utils import start_server

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Paris is the capital of France.", "a", "Embeddings pool the hidden states of every position " * 6]


def _hf_vectors(model, ids: list[int]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    return {"last": torch.nn.functional.normalize(h[-1], dim=0), "mean": torch.nn.functional.normalize(h.mean(0), dim=0)}


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen3moe"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_match_transformers(make_hf_model, kind, pooling):
    model, path = make_hf_model(kind)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=8)  # chunked: means gather rows over steps
    prompts = [llm.tokenizer.encode(t)[:120] for t in TEXTS]  # (its window is 256)
    got = llm.embed([{"prompt_token_ids": ids} for ids in prompts], pooling=pooling)
    for ids, vec in zip(prompts, got):
        ref = _hf_vectors(model, ids)[pooling]
        assert len(vec) == model.config.hidden_size
        torch.testing.assert_close(torch.tensor(vec), ref, atol=2e-5, rtol=1e-4)
        assert math.isclose(sum(x * x for x in vec), 1.0, rel_tol=1e-5)


@pytest.fixture(scope="module")
def gguf_llm(default_gguf):
    return LLM(default_gguf, max_num_batched_tokens=32)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vector_does_not_depend_on_its_batch(gguf_llm, pooling):
    """Bit-identical alone, in a batch of 16 (prefill chunks of 32 tokens shared differently),
    and beside a generating request; the generating request's tokens unchanged too."""
    alone = [gguf_llm.embed(t, pooling=pooling)[0] for t in TEXTS]
    batch = gguf_llm.embed([TEXTS[i % len(TEXTS)] for i in range(16)], pooling=pooling)
    assert all(batch[i] == alone[i % len(TEXTS)] for i in range(16))
    gen = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    solo = gguf_llm.generate("Once upon a time", gen)[0].outputs[0].token_ids
    mixed = gguf_llm.generate(["Once upon a time", *TEXTS],
                              [gen] + [SamplingParams(max_tokens=0, pooling=pooling)] * len(TEXTS))
    assert mixed[0].outputs[0].token_ids == solo
    assert [out.embedding for out in mixed[1:]] == alone


def test_prefix_cache_hit_gives_the_same_vector(gguf_llm):
    """A text whose blocks are cached: the last position is still computed (last pooling reads
    the cache), and mean pooling computes every position again."""
    long = TEXTS[-1] * 3
    for pooling in ("last", "mean"):
        first = gguf_llm.embed(long, pooling=pooling)[0]
        assert gguf_llm.embed(long, pooling=pooling)[0] == first, pooling
    prefill = gguf_llm.engine.prefill_tokens
    gguf_llm.embed(long, pooling="last")
    assert gguf_llm.engine.prefill_tokens - prefill < len(gguf_llm.tokenizer.encode(long)) // 2  # it hit the cache
    prefill = gguf_llm.engine.prefill_tokens
    gguf_llm.embed(long, pooling="mean")
    assert gguf_llm.engine.prefill_tokens - prefill == len(gguf_llm.tokenizer.encode(long))  # it did not


def test_pooling_parameters_are_checked(gguf_llm):
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(max_tokens=0, pooling="cls")
    with pytest.raises(InvalidRequestError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="last")
    with pytest.raises(InvalidRequestError, match="context window"):
        gguf_llm.embed([0] * (gguf_llm.max_model_len + 1))


# --- the server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(default_gguf):
    s = start_server(["--model", str(default_gguf), "--kv-cache-memory", "48M", "--max-num-batched-tokens", "64",
                      "--max-model-len", "512", "--log-level", "warning"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_embeddings_create(client):
    model = client.models.list().data[0]
    card = model.model_dump()
    assert card["embeddings"] == {"dimensions": 576, "pooling": "last"}
    floats = client.embeddings.create(model=model.id, input=TEXTS[0], encoding_format="float")
    b64 = client.embeddings.create(model=model.id, input=TEXTS[0], encoding_format="base64")
    # float32 little-endian, as OpenAI's (the client decodes it itself when the caller names no format)
    assert np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4").tolist() == floats.data[0].embedding
    assert client.embeddings.create(model=model.id, input=TEXTS[0]).data[0].embedding == floats.data[0].embedding
    assert len(floats.data[0].embedding) == 576
    v = torch.tensor(floats.data[0].embedding)
    assert float(v @ v) == pytest.approx(1.0, abs=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # alone, then in a batch of 16 with other texts, then again (its blocks now cached)
    batch = client.embeddings.create(model=model.id, input=[TEXTS[i % len(TEXTS)] for i in range(16)])
    assert [d.index for d in batch.data] == list(range(16))
    assert batch.data[0].embedding == floats.data[0].embedding
    assert batch.data[5].embedding == floats.data[0].embedding
    assert client.embeddings.create(model=model.id, input=TEXTS[0]).data[0].embedding == floats.data[0].embedding
    # token ids are a text too
    ids = client.embeddings.create(model=model.id, input=[[1, 2, 3, 4]]).data[0].embedding
    assert len(ids) == 576 and ids != floats.data[0].embedding


def test_embeddings_errors(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.embeddings.create(model=model, input=[[5] * 600])
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model=model, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    # a prompt may fill the whole window: nothing is generated after it
    assert len(client.embeddings.create(model=model, input=[[5] * 512]).data[0].embedding) == 576
