"""The compiled routed-experts layer (kernels/routed_experts.py) against SparseMoeBlock's PyTorch
loop over the same block-format experts: the same experts chosen, the same weights and outputs
within float rounding, and each row's bits the same alone or in any batch, on every dispatch path."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM
from nanoinfer.kernels import cpu_kernels
from nanoinfer.models.moe import SparseMoeBlock

from gguf_export import write_gguf_from_hf

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no compiled kernels")


@pytest.fixture(scope="module", params=[("qwen3moe", "Q8_0"), ("mixtral", "Q4_1"), ("qwen2moe", "Q5_0"), ("qwen3moe", "F32")])
def blocks(request, make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    kind, qtype = request.param
    path = write_gguf_from_hf(make_hf_model(kind)[0], tiny_tokenizer_dir,
                              tmp_path_factory.mktemp("moe") / f"{kind}.gguf", qtype)
    model = LLM(path, dtype="auto").loaded.model
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def test_compiled_layer_routes_and_computes_as_the_loop(blocks, quant_path):
    g = torch.Generator().manual_seed(1)
    for block in blocks:
        layer = block.compiled()
        assert layer is not None
        x = torch.randn(33, layer.hidden, generator=g)
        out, choices, weights = layer(x, with_routes=True)
        experts, ref_weights = block.route(x)
        experts, order = experts.sort(dim=-1)  # the layer lists a row's experts in expert order
        assert torch.equal(choices, experts.int())
        torch.testing.assert_close(weights, ref_weights.gather(1, order), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, block._experts(x), rtol=1e-4, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_its_batch(blocks, quant_path):
    g = torch.Generator().manual_seed(2)
    layer = blocks[0].compiled()
    x = torch.randn(24, layer.hidden, generator=g)
    together = layer(x)
    for rows in ([5], [0, 7, 9], list(range(3, 19))):
        assert torch.equal(layer(x[rows]), together[rows])


def test_the_block_runs_the_compiled_layer_on_fp32_cpu_rows(blocks):
    block = blocks[0]
    x = torch.randn(4, block.compiled().hidden)
    expected = block.compiled()(x)
    if block.shared_expert is not None:
        expected = expected + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert torch.equal(block(x), expected)
