"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral) beyond the parity of test_models.py: a
batch whose rows pick different experts, experts in a GGUF's block formats on the quantised
kernels, dense layers among sparse ones, and the roofline's active-expert bytes."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.kernels.quant_linear import QuantLinear
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.models.llama import MLP
from nanoinfer.models.moe import SparseMoeBlock
from nanoinfer.reference import generate_uncached
from test_quant_path import check_alone_and_beside, kernels_or_skip, prompt

from gguf_export import write_gguf_from_hf

QUANTISED = {"qwen2moe": "Q8_0", "qwen3moe": "Q4_0", "mixtral": "Q4_1"}


@pytest.fixture(scope="module")
def moe_ggufs(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_ggufs")
    files = {}
    for kind, qtype in QUANTISED.items():
        model, _ = make_hf_model(kind, kind == "qwen3moe")  # qwen3moe tied: its head reads the quantised table
        files[kind] = write_gguf_from_hf(model, tiny_tokenizer_dir, folder / f"{kind}-{qtype}.gguf", qtype)
    return files


@pytest.mark.parametrize("kind", ["qwen2moe", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_rows_that_pick_different_experts_keep_their_bits(moe_ggufs, kind, dtype):
    """16 rows through one MoE block: they choose many different expert pairs, so each expert
    runs on a different subset of rows; every row's output is the same bits as the row run alone."""
    kernels_or_skip(QUANTISED[kind])
    llm = LLM(moe_ggufs[kind], dtype=dtype)
    block = llm.loaded.model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(16, llm.loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        experts, weights = block.route(x)
        together = block(x)
        alone = torch.cat([block(x[i:i + 1]) for i in range(len(x))])
    assert len({tuple(sorted(r)) for r in experts.tolist()}) >= 4
    assert len(set(experts.flatten().tolist())) == 4  # every expert has rows
    assert torch.equal(together, alone)
    if kind == "mixtral":  # Mixtral renormalises its top-2 weights; Qwen2-MoE (as configured) does not
        torch.testing.assert_close(weights.sum(-1), torch.ones(16))
    else:
        assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("kind", list(QUANTISED))
def test_experts_run_in_their_block_format(moe_ggufs, kind):
    """dtype auto: every expert, the shared one and the attention stay in the file's blocks and run
    on the quantised kernels (the F32 router stays dense); the engine's tokens equal the uncached
    loop on the same kernels and the logits stay close to the dequantised model's."""
    qtype = QUANTISED[kind]
    kernels_or_skip(qtype)
    llm = LLM(moe_ggufs[kind], dtype="auto")
    block = llm.loaded.model.model.layers[0].mlp
    for expert in block.experts:
        assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
        assert expert.down_proj.parts[0].type_name == qtype
    if block.shared_expert is not None:  # (its down rows of 48 are not whole blocks: F16, as llama.cpp falls back)
        assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
    assert not isinstance(block.gate, QuantLinear)
    assert llm.loaded.info["tensor_formats"][qtype] >= 2 * 4 * 3
    p = prompt(11, 1)
    ref, _ = generate_uncached(llm.loaded.model, p, 16, kv_dtype=llm.engine.cache.dtype)
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref
    ids = torch.tensor(prompt(40, 2))
    with torch.inference_mode():
        ours = llm.loaded.model(ForwardBatch.whole(ids))
        dense = LLM(moe_ggufs[kind], dtype="float32").loaded.model(ForwardBatch.whole(ids))
    rms = float((ours - dense).pow(2).mean().sqrt() / dense.pow(2).mean().sqrt())
    assert 1e-5 < rms < 0.1  # rounded to the blocks' precision, not more
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.8


def test_a_request_beside_others_keeps_its_bits(moe_ggufs):
    """Quantised Qwen3-MoE: a request's logprobs alone and among 30 others with chunked prefill
    (its tokens share experts with different neighbours each step): the same bits."""
    kernels_or_skip("Q4_0")
    check_alone_and_beside(moe_ggufs["qwen3moe"], 29, 30, 10, 40)


def test_dense_layers_among_sparse_ones(make_hf_model):
    """Qwen's mlp_only_layers: the listed layers keep a dense MLP (parity in test_models.py)."""
    _, path = make_hf_model("qwen3moe_dense")
    llm = LLM(path)
    assert llm.loaded.config.moe.sparse_layers == [True, False, True]
    kinds = [type(layer.mlp) for layer in llm.loaded.model.model.layers]
    assert kinds == [SparseMoeBlock, MLP, SparseMoeBlock]


def test_roofline_counts_the_experts_a_step_reads(make_hf_model):
    """Batch-1 decode reads top_k of num_experts routed experts per layer (2 of 4 here), plus
    everything else; a large batch reads nearly all of them."""
    from nanoinfer.bench.roofline import Roofline, matmul_params

    _, path = make_hf_model("qwen2moe")
    llm = LLM(path)
    cfg = llm.loaded.config
    roof = Roofline.for_model(llm.loaded.model, cfg)
    h, fe, fs, n = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size, cfg.moe.num_experts
    assert roof.weights.experts == cfg.num_layers * n * 3 * h * fe * 4  # fp32
    assert roof.weights.total == sum(p.numel() * 4 for p in llm.loaded.model.parameters())
    assert roof.fixed_step_bytes(1) == roof.weights.body + roof.weights.lm_head + roof.weights.experts // 2
    assert roof.fixed_step_bytes(64) > roof.weights.total - roof.weights.embedding - 1e-6 * roof.weights.experts
    dense_layer = 2 * h * h + 2 * h * h // 2  # q and o (4 heads of 16), k and v (2 heads)
    per_token = cfg.num_layers * (dense_layer + 3 * h * (2 * fe + fs) + h * n + h) + h * cfg.vocab_size
    assert matmul_params(cfg) == per_token
