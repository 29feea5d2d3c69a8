"""The compiled layer ops (csrc/layer_ops.cpp) against their PyTorch formulas, fp32 and bf16."""
from __future__ import annotations

import shutil

import pytest
import torch

from nanoinfer.kernels import layer_ops

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the kernels cannot be built here")


@pytest.fixture
def plain(monkeypatch):
    """Run a layer op through its PyTorch formula."""
    def call(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(layer_ops, "_compiled", lambda *t: False)
            return fn(*args)
    return call


DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, ref: torch.Tensor, flips: float = 0.01) -> None:
    """fp32: the order of a sum apart. bf16: rounded at the same points as torch, so equal
    but where an fp32 difference of an ulp lands on the other side of a bf16 rounding (at
    most `flips` of the values)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
    else:
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=8e-3)  # one bf16 ulp
        assert (got != ref).float().mean() < flips


def test_kernels_are_used_for_fp32_and_bf16_on_the_cpu():
    assert layer_ops._compiled(torch.zeros(2, 2)) and layer_ops._compiled(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not layer_ops._compiled(torch.zeros(2, 2, dtype=torch.float16))
    assert not layer_ops._compiled(torch.zeros(2, 2), torch.zeros(2, dtype=torch.bfloat16))  # mixed: the formula


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 600])  # one row, a decode batch, enough for threads
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(plain, dtype, rows, with_weight):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    weight = torch.randn(576).to(dtype) if with_weight else None
    ref, ref_stream = plain(layer_ops.rms_norm, x, weight, 1e-5)
    got, stream = layer_ops.rms_norm(x, weight, 1e-5)
    close(got, ref)
    assert torch.equal(stream, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place(plain, dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    weight = torch.randn(64).to(dtype)
    ref, ref_stream = plain(layer_ops.rms_norm, x, weight, 1e-6, residual.clone())
    stream_in = residual.clone()
    got, stream = layer_ops.rms_norm(x, weight, 1e-6, stream_in)
    assert stream.data_ptr() == stream_in.data_ptr()  # the caller's stream, updated
    assert torch.equal(stream, ref_stream)  # one add, rounded as torch rounds it: bit for bit
    close(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_rope_on_a_strided_slice(plain, dtype, rows):
    """q and k as they come out of a fused qkv projection: rows wider than the heads."""
    torch.manual_seed(rows)
    H, Hkv, D = 9, 3, 64
    qkv = torch.randn(rows, (H + 2 * Hkv) * D).to(dtype)
    x = qkv[:, :(H + Hkv) * D].view(rows, H + Hkv, D)
    angles = torch.rand(rows, 1, D // 2) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = layer_ops.rope(x, cos, sin)
    assert got.is_contiguous()
    ref = plain(layer_ops.rope, x, cos, sin)
    if dtype == torch.bfloat16:  # the same roundings in the same order: bit for bit
        assert torch.equal(got, ref)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_rope_takes_non_contiguous_heads(plain):
    """A strided head layout the kernel does not take goes through the formula, same result."""
    x = torch.randn(4, 64, 3).transpose(1, 2)  # [T, heads, D] with head_dim not innermost
    angles = torch.rand(4, 1, 32)
    torch.testing.assert_close(layer_ops.rope(x, angles.cos(), angles.sin()),
                               plain(layer_ops.rope, x, angles.cos(), angles.sin()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul(plain, dtype, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 20.0, -20.0])  # the tails of exp
    gate_up = gate_up.to(dtype)
    close(layer_ops.silu_mul(gate_up), plain(layer_ops.silu_mul, gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_gelu_tanh_mul(plain, dtype, rows):
    """Gemma's gelu_tanh(gate) * up: the kernel's tanh (through e^-2|u|) against torch's."""
    torch.manual_seed(rows + 1)
    gate_up = torch.randn(rows, 2 * 1152) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 5.0, -5.0])  # tanh's tails and zero
    gate_up = gate_up.to(dtype)
    # 1 + tanh(v) cancels for gates below zero, so tanh's last bit (ours against torch's) moves
    # the product's more than silu's: more values land across a bf16 rounding
    close(layer_ops.gelu_tanh_mul(gate_up), plain(layer_ops.gelu_tanh_mul, gate_up), flips=0.03)
