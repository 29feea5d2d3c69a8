"""CPU linear layers swapped in at load, their weights packed once: bf16 for oneDNN, fp32 for
the compiled GEMM. Same results, same parameters, same bytes, same tokens."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels import cpu_kernels
from nanoinfer.kernels.cpu_linear import PackedLinear, adapt_linears, packing_supported
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.models.builder import load_model
from nanoinfer.reference import generate_uncached

needs_onednn = pytest.mark.skipif(not packing_supported(), reason="this torch build or CPU has no oneDNN bf16")
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the kernels cannot be built here")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32, 300])
def test_packed_linear_computes_the_same(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    ref = F.linear(x, linear.weight, linear.bias).float()
    got = PackedLinear(linear, tied=False)(x).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=1e-2)  # bf16 outputs: rounding of the last bit
    assert (got - ref).abs().mean() < 1e-3


@needs_compiler
@pytest.mark.parametrize("shape", [(96, 200), (576, 960), (37, 13), (5, 64)])  # K, N: N a multiple of 32 or not
def test_pack_f32_round_trips(shape):
    w = torch.randn(shape[1], shape[0])
    packed = cpu_kernels.pack_f32(w)
    assert packed.shape == w.shape and not torch.equal(packed, w)  # same size, another order
    assert torch.equal(cpu_kernels.unpack_f32(packed), w)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 25, 96, 97, 300])  # register tiles of 12, row chunks of 96
@pytest.mark.parametrize("shape", [(96, 200), (576, 960), (37, 13), (1536, 64)])  # K, N: whole panels or not
@pytest.mark.parametrize("bias", [False, True])
def test_packed_f32_linear_computes_the_same(rows, shape, bias):
    torch.manual_seed(rows)
    K, N = shape
    linear = torch.nn.Linear(K, N, bias=bias)
    x = torch.randn(rows, K)
    got = PackedLinear(linear, tied=False)(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


@needs_compiler
def test_packed_f32_rows_do_not_depend_on_the_batch():
    """A row's output is bit-identical alone, in any tile position and in any batch size."""
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(160, 200, bias=True), tied=False)
    x = torch.randn(101, 160)
    whole = layer(x)
    for r in (0, 11, 12, 50, 100):
        assert torch.equal(layer(x[r:r + 1]), whole[r:r + 1])
    assert torch.equal(layer(x[7:40]), whole[7:40])


@needs_compiler
def test_packed_f32_linear_takes_any_leading_dims():
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(PackedLinear(linear, tied=False)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_other_linears_are_left_alone():
    fp16 = torch.nn.Sequential(torch.nn.Linear(8, 8).half())
    assert adapt_linears(fp16) == 0 and isinstance(fp16[0], torch.nn.Linear)


def dense_copy(model: torch.nn.Module, tied: bool) -> torch.nn.Module:
    """The same model with plain nn.Linear layers again (same weights)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                if tied and name == "lm_head":
                    linear.weight = model.model.embed_tokens.weight
                else:
                    linear.weight = torch.nn.Parameter(child.dense_weight(), requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)
    return model


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=needs_onednn), pytest.param(torch.float32, marks=needs_compiler)])
@pytest.mark.parametrize("tie", [False, True])
def test_adapted_model_keeps_sizes_and_outputs(make_hf_model, tie, dtype):
    """Loading swaps every linear; the parameter count, the logits of a decode-sized batch
    and the greedy tokens are those of the same model with plain linears."""
    _, path = make_hf_model("llama", tie=tie)
    adapted = load_model(path, dtype=dtype).model
    assert not any(isinstance(m, torch.nn.Linear) for m in adapted.modules())
    plain = dense_copy(load_model(path, dtype=dtype).model, tie)
    assert sum(p.numel() for p in adapted.parameters()) == sum(p.numel() for p in plain.parameters())
    ids = torch.tensor([3, 17, 92, 5, 44, 8, 120, 77])  # a decode-sized batch
    tol = dict(atol=0.1, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(adapted(ForwardBatch.whole(ids)), plain(ForwardBatch.whole(ids)), **tol)
    prompt = ids.tolist()[:6]
    assert generate_uncached(adapted, prompt, 12)[0] == generate_uncached(plain, prompt, 12)[0]
