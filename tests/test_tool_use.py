"""The tool-use state machine, driven by a scripted model that emits a calculator call."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nanoinfer.config import ModelConfig
from nanoinfer.engine import LLMEngine
from nanoinfer.models.builder import LoadedModel
from nanoinfer.sampling import SamplingParams
from nanoinfer.tokenizer import Tokenizer

TOOL_TOKENS = ["<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]


class ScriptedModel(nn.Module):
    """Emits a fixed token sequence, one token per forward that asks for logits, and
    records what each forward was fed."""

    def __init__(self, config: ModelConfig, script: list[int]):
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the engine a dtype and a device
        self.script = list(script)
        self.fed: list[list[int]] = []

    def forward(self, batch):  # a ForwardBatch
        self.fed.append(batch.input_ids.tolist())
        n = 0 if batch.logits_indices is None else len(batch.logits_indices)
        logits = torch.zeros(n, self.config.vocab_size)
        for row in range(n):
            logits[row, self.script.pop(0)] = 10.0
        return logits


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_tokenizer_dir, tmp_path_factory) -> Tokenizer:
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    path = tmp_path_factory.mktemp("tool_tok")
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_TOKENS])
    backend.save(str(path / "tokenizer.json"))
    return Tokenizer.from_hf_folder(path)


def run(tokenizer: Tokenizer, script: list[int], max_tokens: int = 40):
    config = ModelConfig("scripted", tokenizer.vocab_size, 8, 16, 1, 1, 1, 8, max_position_embeddings=128)
    model = ScriptedModel(config, script)
    engine = LLMEngine(LoadedModel(model, tokenizer, config, None, "scripted", 0.0))
    engine.add_request("r", tokenizer.encode("Q:"), SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished():
        engine.step()
    return engine.release("r").outputs[0], model.fed


def test_calculator_call_is_answered_in_one_forward(tool_tokenizer):
    tok = tool_tokenizer
    ps, pe, os_, oe = (tok.token_to_id(t) for t in TOOL_TOKENS)
    expr, after = tok.encode("2+3*4", add_special_tokens=False), tok.encode(" ok", add_special_tokens=False)
    eos = tok.eos_token_id
    out, fed = run(tok, [ps, *expr, pe, *after, eos])
    result = tok.encode("14", add_special_tokens=False)
    forced = [os_, *result, oe]
    assert out.token_ids == [ps, *expr, pe, *forced, *after, eos]
    assert out.token_masks == [1] * (len(expr) + 2) + [0] * len(forced) + [1] * (len(after) + 1)
    # python_end (sampled, not yet computed) and all forced tokens went through one forward
    assert [pe, *forced] in fed
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("bad", ["2**10", "import os", "1/0", "x+1"])
def test_failing_expression_injects_nothing(tool_tokenizer, bad):
    tok = tool_tokenizer
    ps, pe = tok.token_to_id(TOOL_TOKENS[0]), tok.token_to_id(TOOL_TOKENS[1])
    expr = tok.encode(bad, add_special_tokens=False)
    out, _ = run(tok, [ps, *expr, pe, tok.eos_token_id])
    assert out.token_ids == [ps, *expr, pe, tok.eos_token_id]
    assert out.token_masks == [1] * len(out.token_ids)


def test_tool_output_respects_max_tokens(tool_tokenizer):
    tok = tool_tokenizer
    ps, pe = tok.token_to_id(TOOL_TOKENS[0]), tok.token_to_id(TOOL_TOKENS[1])
    expr = tok.encode("2+3*4", add_special_tokens=False)
    out, _ = run(tok, [ps, *expr, pe, 5, 5, 5], max_tokens=len(expr) + 3)
    assert len(out.token_ids) == len(expr) + 3 and out.finish_reason == "length"


def test_nanochat_compat_engine_columns_and_masks(tool_tokenizer):
    """nanochat's Engine API: one column per step, forced tokens with mask 0, terminal token dropped
    by generate_batch, and rows that end early padded in the stream."""
    from nanoinfer.compat.nanochat import Engine

    tok = tool_tokenizer
    ps, pe, os_, oe = (tok.token_to_id(t) for t in TOOL_TOKENS)
    expr = tok.encode("6*7", add_special_tokens=False)
    eos = tok.eos_token_id
    config = ModelConfig("scripted", tok.vocab_size, 8, 16, 1, 1, 1, 8, max_position_embeddings=128)
    prompt = tok.encode("Q:")
    script = [ps, *expr, pe, 7, eos]
    engine = Engine(ScriptedModel(config, list(script)), tok)
    columns = list(engine.generate(prompt, num_samples=1, max_tokens=30, temperature=0))
    forced = [os_, *tok.encode("42", add_special_tokens=False), oe]
    assert [c[0][0] for c in columns] == [ps, *expr, pe, *forced, 7, eos]
    assert [c[1][0] for c in columns] == [1] * (len(expr) + 2) + [0] * len(forced) + [1, 1]
    engine = Engine(ScriptedModel(config, list(script)), tok)
    seqs, masks = engine.generate_batch(prompt, num_samples=1, max_tokens=30, temperature=0)
    assert seqs[0] == prompt + [ps, *expr, pe, *forced, 7]
    assert masks[0] == [0] * len(prompt) + [1] * (len(expr) + 2) + [0] * len(forced) + [1]
    assert engine.engine.blocks.num_used == 0
