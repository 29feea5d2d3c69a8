"""The default SmolLM2-135M-Instruct GGUF against transformers loading the same file."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams

RAW = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a land far away,"]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}],
]
STEPS = 32


@pytest.fixture(scope="module")
def hf(hf_default):
    return hf_default


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(default_gguf, dtype="float32")  # transformers runs the dequantised weights in fp32


def hf_chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def hf_greedy(model, ids: list[int], eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=STEPS, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("i", range(len(RAW)))
def test_raw_prompt_greedy(hf, llm, i):
    tok, model = hf
    ids = llm.tokenizer.encode(RAW[i])
    assert ids == tok(RAW[i])["input_ids"]
    eos = sorted(llm.tokenizer.eos_token_ids)
    ours = llm.generate(RAW[i], SamplingParams(temperature=0, max_tokens=STEPS))[0].outputs[0].token_ids
    assert ours == hf_greedy(model, ids, eos)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_greedy(hf, llm, i):
    tok, model = hf
    ids = llm.chat_ids(CHATS[i])
    assert ids == hf_chat_ids(tok, CHATS[i])
    eos = sorted(llm.tokenizer.eos_token_ids)
    out = llm.chat(CHATS[i], SamplingParams(temperature=0, max_tokens=STEPS))[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(model, ids, eos)
    assert out.outputs[0].text.strip()


def test_eos_ids_include_turn_end(llm):
    """The file says eos = <|im_start|>; the chat turn ends at <|im_end|>, which must stop generation."""
    im_end = llm.tokenizer.token_to_id("<|im_end|>")
    assert im_end in llm.tokenizer.eos_token_ids
