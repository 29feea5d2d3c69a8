"""bf16 linear layers packed for oneDNN at load: same results, same parameters, same bytes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.cpu_linear import PackedLinear, pack_linears, packing_supported
from nanoinfer.loaders import load_model
from nanoinfer.reference import generate_uncached

pytestmark = pytest.mark.skipif(not packing_supported(), reason="this torch build or CPU has no oneDNN bf16")


@pytest.mark.parametrize("rows", [1, 3, 32, 300])
def test_packed_linear_computes_the_same(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    ref = F.linear(x, linear.weight, linear.bias).float()
    got = PackedLinear(linear, tied=False)(x).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=1e-2)  # bf16 outputs: rounding of the last bit
    assert (got - ref).abs().mean() < 1e-3


def test_only_bf16_linears_are_packed():
    fp32 = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert pack_linears(fp32) == 0 and isinstance(fp32[0], torch.nn.Linear)


@pytest.mark.parametrize("tie", [False, True])
def test_packed_model_keeps_sizes_and_outputs(make_hf_model, tie):
    """Loading in bf16 packs every linear; the parameter count and the greedy tokens are
    those of the same model with plain linears."""
    _, path = make_hf_model("llama", tie=tie)
    packed = load_model(path, dtype=torch.bfloat16).model
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    plain = load_model(path, dtype=torch.bfloat16).model
    for parent in list(plain.modules()):  # undo the packing: plain nn.Linear again, same weights
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight = (plain.model.embed_tokens.weight if tie and name == "lm_head"
                                 else torch.nn.Parameter(child.weight.to_dense(), requires_grad=False))
                linear.bias = child.bias
                setattr(parent, name, linear)
    assert sum(p.numel() for p in packed.parameters()) == sum(p.numel() for p in plain.parameters())
    prompt = [3, 17, 92, 5, 44, 8]
    with torch.inference_mode():
        torch.testing.assert_close(packed(torch.tensor(prompt), torch.arange(6)),
                                   plain(torch.tensor(prompt), torch.arange(6)), atol=0.1, rtol=0.05)
    assert generate_uncached(packed, prompt, 12)[0] == generate_uncached(plain, prompt, 12)[0]
