"""Parity with transformers on tiny random models, through the real loading path."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.attention import ContiguousKVCache
from nanoinfer.loaders import load_model
from nanoinfer.reference import generate_uncached

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("mistral", False)]
STEPS = 40


def prompt_ids(vocab: int, n: int = 12, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def hf_greedy(model, ids: list[int], steps: int):
    """transformers' own cached greedy loop: tokens and the logits of every step."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(ids):].tolist(), [l[0].float() for l in out.logits]


def check_parity(hf_model, loaded, steps: int = STEPS):
    vocab = loaded.config.vocab_size
    ids = prompt_ids(vocab)
    # prefill: every position's logits
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
        ours = loaded.model(torch.tensor(ids), torch.arange(len(ids)))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # decode: our cached loop against transformers' cached loop, logits at every step
    ref_tokens, ref_logits = hf_greedy(hf_model, ids, steps)
    c = loaded.config
    cache = ContiguousKVCache(c.num_layers, len(ids) + steps, c.num_kv_heads, c.head_dim, window=c.sliding_window)
    seq, start, tokens = list(ids), 0, []
    with torch.no_grad():
        for step in range(steps):
            new = seq[start:]
            logits = loaded.model(torch.tensor(new), torch.arange(start, start + len(new)),
                                  cache.at(start, len(new)), torch.tensor([len(new) - 1]))[0]
            torch.testing.assert_close(logits, ref_logits[step], atol=1e-4, rtol=0, msg=lambda m: f"step {step}: {m}")
            start = len(seq)
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            seq.append(tok)
    assert tokens == ref_tokens
    return ids, ref_tokens


@pytest.mark.parametrize("kind,tie", CASES)
def test_hf_folder_parity(make_hf_model, kind, tie):
    hf_model, path = make_hf_model(kind, tie)
    loaded = load_model(path)
    assert loaded.config.architecture == kind
    assert loaded.config.tie_word_embeddings == tie
    assert loaded.config.num_kv_heads < loaded.config.num_heads  # GQA
    ids, ref_tokens = check_parity(hf_model, loaded)
    # and the engine's own greedy loop gives the same tokens
    llm = LLM(path)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref_tokens


@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_parity(make_hf_model, tiny_tokenizer_dir, tmp_path, kind, tie):
    from gguf_export import write_gguf_from_hf

    hf_model, _ = make_hf_model(kind, tie)
    path = tmp_path / "model.gguf"
    write_gguf_from_hf(hf_model, tiny_tokenizer_dir, path)
    loaded = load_model(path)
    assert loaded.format == "gguf"
    check_parity(hf_model, loaded)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cached_equals_uncached(make_hf_model, kind):
    """The reference loop (no cache, full forward each step) and the engine agree token for token.
    Mistral's window of 8 is far shorter than the sequence, so the sliding mask is exercised."""
    _, path = make_hf_model(kind)
    llm = LLM(path)
    ids = prompt_ids(llm.loaded.config.vocab_size, n=20, seed=3)
    ref, _ = generate_uncached(llm.loaded.model, ids, 48)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref
