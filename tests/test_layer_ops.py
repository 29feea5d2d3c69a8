"""The compiled fp32 layer ops (csrc/layer_ops.cpp) against their PyTorch formulas."""
from __future__ import annotations

import shutil

import pytest
import torch

from nanoinfer import layer_ops

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


def test_kernels_are_used_for_fp32_on_the_cpu():
    assert layer_ops._compiled(torch.zeros(2, 2))
    assert not layer_ops._compiled(torch.zeros(2, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 7, 600])  # one row, a decode batch, enough for threads
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(plain, rows, with_weight):
    torch.manual_seed(rows)
    x = torch.randn(rows, 576) * 3
    weight = torch.randn(576) if with_weight else None
    ref, ref_stream = plain(layer_ops.rms_norm, x, weight, 1e-5)
    got, stream = layer_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(stream, x)


def test_rms_norm_adds_the_residual_in_place(plain):
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    weight = torch.randn(64)
    ref, ref_stream = plain(layer_ops.rms_norm, x, weight, 1e-6, residual.clone())
    stream_in = residual.clone()
    got, stream = layer_ops.rms_norm(x, weight, 1e-6, stream_in)
    assert stream.data_ptr() == stream_in.data_ptr()  # the caller's stream, updated
    assert torch.equal(stream, ref_stream)  # one fp32 add: bit for bit
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows", [1, 300])
def test_rope_on_a_strided_slice(plain, rows):
    """q and k as they come out of a fused qkv projection: rows wider than the heads."""
    torch.manual_seed(rows)
    H, Hkv, D = 9, 3, 64
    qkv = torch.randn(rows, (H + 2 * Hkv) * D)
    x = qkv[:, :(H + Hkv) * D].view(rows, H + Hkv, D)
    angles = torch.rand(rows, 1, D // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    got = layer_ops.rope(x, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, plain(layer_ops.rope, x, cos, sin), atol=1e-6, rtol=1e-6)


def test_rope_takes_non_contiguous_heads(plain):
    """A strided head layout the kernel does not take goes through the formula, same result."""
    x = torch.randn(4, 64, 3).transpose(1, 2)  # [T, heads, D] with head_dim not innermost
    angles = torch.rand(4, 1, 32)
    torch.testing.assert_close(layer_ops.rope(x, angles.cos(), angles.sin()),
                               plain(layer_ops.rope, x, angles.cos(), angles.sin()))


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul(plain, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 20.0, -20.0])  # the tails of exp
    got = layer_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, plain(layer_ops.silu_mul, gate_up), atol=1e-6, rtol=2e-6)
