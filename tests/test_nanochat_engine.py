"""nanochat models through nanoinfer's surfaces: the compat Engine, llm.chat, the CLI."""
from __future__ import annotations

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.cli import main
from nanoinfer.compat.nanochat import Engine

from nanochat_fixtures import build_encoding, random_state, write_checkpoint, write_tokenizer

KV = dict(kv_cache_memory=1 << 22)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("nanochat_engine")
    write_tokenizer(root, build_encoding())
    write_checkpoint(root, "chatsft", "d4", 10, random_state("F", seed=3))
    return root


@pytest.fixture(scope="module")
def llm(root):
    return LLM(root, **KV)


def test_compat_generate_columns_equal_engine_greedy(llm):
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    ref = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    engine = Engine(llm.loaded.model, llm.tokenizer)
    columns = list(engine.generate(prompt, num_samples=3, max_tokens=12, temperature=0.0))
    rows = list(zip(*[c for c, _ in columns]))
    # greedy: every row is the same, and equals the offline API's output
    assert all(r == rows[0] for r in rows)
    assert list(rows[0][:len(ref.token_ids)]) == ref.token_ids
    assert all(m == [1, 1, 1] for _, m in columns[:len(ref.token_ids)])


def test_compat_generate_batch_samples(llm):
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story"}])
    engine = Engine(llm.loaded.model, llm.tokenizer)
    seqs, masks = engine.generate_batch(prompt, num_samples=4, max_tokens=10, temperature=1.0, seed=7)
    assert len(seqs) == 4 and all(s[:len(prompt)] == prompt for s in seqs)
    assert all(len(s) == len(m) for s, m in zip(seqs, masks))
    assert all(m[:len(prompt)] == [0] * len(prompt) for m in masks)
    end = llm.tokenizer.special_ids["<|assistant_end|>"]
    assert all(end not in s[len(prompt):] for s in seqs)  # the terminal token is dropped
    assert len({tuple(s) for s in seqs}) > 1  # samples differ
    again, _ = Engine(llm.loaded.model, llm.tokenizer).generate_batch(prompt, num_samples=4, max_tokens=10,
                                                                      temperature=1.0, seed=7)
    assert again == seqs  # and repeat under the same seed
    assert engine.engine.blocks.num_used == 0


def test_chat_and_cli_on_nanochat(root, llm, capsys):
    out = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                   SamplingParams(temperature=0, max_tokens=6))[0]
    assert "<|" not in out.outputs[0].text  # special tokens are never printed raw
    assert main(["generate", "hi", "--chat", "--model", str(root), "-t", "0", "-n", "6"]) == 0
    assert "<|" not in capsys.readouterr().out


def test_conversation_longer_than_sequence_len(root, llm):
    """By default the context window is sequence_len: a longer prompt is a clear error and a
    long generation ends with finish_reason length. With max_position_embeddings raised
    (up to 10x), generation slides past sequence_len as nanochat's windows allow."""
    from nanoinfer import InvalidRequestError
    seq_len = llm.loaded.config.extra["sequence_len"]
    assert llm.max_model_len == seq_len
    with pytest.raises(InvalidRequestError, match="context window"):
        llm.generate({"prompt_token_ids": [5] * seq_len}, SamplingParams(max_tokens=4))
    out = llm.generate({"prompt_token_ids": [5] * (seq_len - 4)},
                       SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert out.finish_cause.value == "context_full" and len(out.token_ids) == 4
    long = LLM(root, model_overrides={"max_position_embeddings": 2 * seq_len}, **KV)
    out = long.generate({"prompt_token_ids": [5] * (seq_len - 4)},
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"


def test_compat_engine_raises_a_failed_request(llm, monkeypatch):
    """An error inside one request's sampling ends it with RequestFailedError in nanochat's
    API too (before, generate() looped for ever and generate_batch returned aborted rows)."""
    from nanoinfer.errors import RequestFailedError
    from nanoinfer.sampling import RowSampler

    commit = RowSampler.commit

    def faulty(self, token, generator_state=None):
        if self.num_generated == 2:
            raise ArithmeticError("injected")
        return commit(self, token, generator_state)

    monkeypatch.setattr(RowSampler, "commit", faulty)
    engine = Engine(llm.loaded.model, llm.tokenizer)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(RequestFailedError, match="injected"):
        list(engine.generate(prompt, num_samples=2, max_tokens=8))
    with pytest.raises(RequestFailedError, match="injected"):
        engine.generate_batch(prompt, num_samples=2, max_tokens=8)
    assert not engine.engine.requests and not engine.engine.has_unfinished()
