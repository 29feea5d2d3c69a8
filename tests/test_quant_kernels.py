"""The quantised-weight CPU kernels (csrc/quant_gemm.cpp through nanoinfer/kernels/quant.py)
against gguf's own dequantisation, in fp64.

The kernels quantise each activation row per block (max|x| / 127, ties to even), as
llama.cpp does, so they are checked twice:
- tight: against x_hat @ W^T, x_hat the activations quantised here the same way (fp32 steps,
  as the C++ does them), within fp32 rounding: (chain + 16) * 2^-24 * sum |x_hat| |w_parts|;
- the bound of the method: against x @ W^T, within that plus sum_i |w_i| * d_x(i) * 0.501 (each
  activation moves by at most half a step d_x / 2 of its block, d_x = max|x| / 127).
And the rest of the contract: bit-identical rows whatever the batch, the same bits on every
path and in either layout (as stored, and the 32-value types' repacked one), dequantize_rows
exactly gguf's values, clear errors for bad arguments.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import kernel_builds
from nanoinfer.errors import SettingError
from nanoinfer.kernels import cpu_kernels, quant
from nanoinfer.tensors import QuantizedTensor

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernels cannot be built here", allow_module_level=True)

TYPES = list(quant.QUANT_TYPES)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
FLOATS = (T.F32, T.F16, T.BF16)  # one value a block, fp32 activations
WITH_MIN = {T.Q4_1: 2, T.Q5_1: 2, T.Q4_K: 2, T.Q5_K: 2}  # byte offset of the fp16 min (dmin) in a block
# 5, 6: rows in one tile (AVX2; Q5_K, Q6_K on 512-bit vectors); 14: 8 + 6, not streamed; 17: 8 + 8 + 1;
# AMX (from 32 rows): 33, A tiles of 16 and 16, the last row on the AVX-512 tiles; 41, A tiles of 16, 16, 9
MS = (1, 2, 3, 5, 6, 8, 14, 17, 33, 41, 64)
REPACKABLE = [t for t in TYPES if quant.RECORDS[t].interleave > 1]
CASES = [(t, False) for t in TYPES] + [(t, True) for t in REPACKABLE]  # (type, repacked)


def case_id(case) -> str:
    return T(case[0]).name + ("-repacked" if case[1] else "")


def layout(w: torch.Tensor, qtype: int, K: int, repacked: bool) -> torch.Tensor:
    """w's bytes in the layout the case runs: as stored, or repacked by quant.repack."""
    if not repacked:
        return w
    t = quant.repack(QuantizedTensor(w, qtype, (w.shape[0], K), T(qtype).name))
    assert t.repacked and t.data.shape == w.shape and not torch.equal(t.data, w)
    return t.data


def test_kernel_builds():
    """With a compiler the library must build and every listed type must have a kernel."""
    assert cpu_kernels.library() is not None
    assert all(quant.supported(t) for t in TYPES)
    assert not quant.supported(T.Q2_K) and not quant.supported(T.IQ2_XXS)
    assert "portable" in quant.paths()
    flags = Path("/proc/cpuinfo").read_text().split() if os.path.exists("/proc/cpuinfo") else []
    if {"avx2", "fma", "f16c"} <= set(flags):
        assert "avx2" in quant.paths()


def test_kernels_build_for_a_plain_x86_64(tmp_path):
    """Each SIMD path carries its own target attributes, so every source builds for an x86-64
    without AVX (where the dispatch then picks the portable path): a helper left without the
    attribute (a lambda inside a kernel is one) fails here rather than on a user's older CPU."""
    import platform
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86 check")
    for src in cpu_kernels.SOURCES:
        proc = subprocess.run([cpu_kernels.find_compiler(), "-O0", "-march=x86-64", "-std=c++17", "-fopenmp", "-fPIC",
                               "-w", "-c", str(src), "-o", str(tmp_path / "kernel.o")], capture_output=True, text=True)
        assert proc.returncode == 0, f"{src.name}: {proc.stderr[-1500:]}"


def shape(qtype: int, N: int = 37) -> tuple[int, int]:
    """[N, K]: K a multiple of the block but not of 256 (not of 16 for F32/F16/BF16), N odd."""
    if qtype in K_QUANTS:
        return N, 768
    if qtype in FLOATS:
        return N, 100
    return N, 352  # 11 blocks of 32: a group of 8 and a tail of 3


def scale_at(qtype: int) -> int:
    """The byte offset of a K-quant block's fp16 scale d (Q6_K keeps it last)."""
    return 208 if qtype == T.Q6_K else 0


def make_weights(qtype: int, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random [N, row_bytes] uint8 blocks: gguf's quantiser where it has one, else random
    bytes with fp16 scales of either sign (and one zero scale)."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in K_QUANTS:
        W = (rng.standard_normal((N, K)) * rng.uniform(0.01, 0.2, (N, 1))).astype(np.float32)
        W[:, rng.integers(0, K, 3)] *= 8  # outliers: blocks of very different scales
        q = gguf.quants.quantize(W, qtype)
        return np.ascontiguousarray(q).view(np.uint8).reshape(N, K // bs * ts)
    raw = rng.integers(0, 256, (N, K // bs, ts), dtype=np.uint8)
    d_at = scale_at(qtype)
    scales = (rng.standard_normal((N, K // bs, 2)) * 2e-3).astype(np.float16)
    scales[0, 0] = 0
    raw[:, :, d_at:d_at + 2] = scales[:, :, :1].view(np.uint8)
    if qtype in WITH_MIN:
        raw[:, :, 2:4] = scales[:, :, 1:].view(np.uint8)
    return raw.reshape(N, -1)


def dequantize(w: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(w, qtype).astype(np.float64)


def quantize_x(x: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_hat (fp64) and each value's step d_x (fp64), computed in fp32 as the C++ does."""
    if qtype in FLOATS:
        return x.double(), torch.zeros_like(x, dtype=torch.float64)
    B = 256 if qtype in K_QUANTS else 32
    M, K = x.shape
    xb = x.reshape(M, K // B, B)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax * torch.tensor(np.float32(1) / np.float32(127))
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xb * inv).clamp(-127, 127)
    x_hat = (q.double() * d.double()).reshape(M, K)
    return x_hat, d.double().expand(M, K // B, B).reshape(M, K)


def magnitude(x_hat: torch.Tensor, w: np.ndarray, qtype: int) -> torch.Tensor:
    """sum over k of |x_hat| times the size of the parts the kernel sums (for formats with a
    min, the scaled part and the min part apart: they are summed separately)."""
    Wd = dequantize(w, qtype)
    parts = np.abs(Wd)
    if qtype in WITH_MIN:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        no_min = w.reshape(w.shape[0], -1, ts).copy()
        no_min[:, :, 2:4] = 0
        scaled = dequantize(no_min.reshape(w.shape), qtype)
        parts = np.abs(scaled) + np.abs(Wd - scaled)
    return x_hat.abs() @ torch.from_numpy(parts).T


def chain(qtype: int, K: int) -> int:
    """Roundings that can reach one output: the per-block (or per-k) fused multiply-adds of a
    lane, plus the products of scales, the conversions and the final sums."""
    if qtype in FLOATS:
        return K // 16 + 1
    per_block = {T.Q4_1: 3, T.Q5_1: 3, T.Q4_K: 4, T.Q5_K: 4}.get(qtype, 2)  # the mins join the chain
    return per_block * (K // gguf.GGML_QUANT_SIZES[qtype][0]) + 2


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_dequantised(case, quant_path):
    qtype, repacked = case
    N, K = shape(qtype)
    w_np = make_weights(qtype, N, K)
    w = layout(torch.from_numpy(w_np), qtype, K, repacked)
    Wd = torch.from_numpy(dequantize(w_np, qtype))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(MS), K, generator=g) * torch.rand(max(MS), 1, generator=g) * 3
    x[3] = 0  # an all-zero row: every block scale 0
    x[:, 5] *= 20  # an outlier feature
    bias = torch.randn(N, generator=g)
    x_hat, step = quantize_x(x, qtype)
    mag = magnitude(x_hat, w_np, qtype)
    tight = (chain(qtype, K) + 16) * 2.0 ** -24 * mag + 1e-30
    method = (step * 0.501) @ Wd.abs().T  # |x_hat - x| <= d_x / 2 (and fp32 rounding of d, 1/d)
    for M in MS:
        for b in (None, bias):
            y = quant.linear(x[:M].contiguous(), w, qtype, b, repacked).double()
            extra = 0 if b is None else b.double()
            tol = tight[:M] + (0 if b is None else 2.0 ** -24 * b.double().abs())  # the bias add rounds once more
            assert y.shape == (M, N)
            err_tight = (y - (x_hat[:M] @ Wd.T + extra)).abs()
            assert (err_tight <= tol).all(), f"M={M}: {(err_tight / tol).max():.3g} x the fp32 bound"
            err = (y - (x[:M].double() @ Wd.T + extra)).abs()
            assert (err <= method[:M] + tol).all(), f"M={M}: {(err / (method[:M] + tol)).max():.3g} x the bound"
    if qtype not in FLOATS:  # the bound is not vacuous: the error reaches a fair share of it
        y = quant.linear(x, w, qtype, repacked=repacked).double()
        assert ((y - x.double() @ Wd.T).abs() / (method + tight)).max() > 0.05


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("N", [37, 301])  # 301: enough work that the threads split N
def test_rows_do_not_depend_on_the_batch(case, quant_path, N):
    """Row r's output bits are the same alone, in any prefix of the batch, in any order and
    tile position (tiles of 4 rows, pairs or groups of 8 weight rows, threads splitting N)."""
    qtype, repacked = case
    _, K = shape(qtype)
    w = layout(torch.from_numpy(make_weights(qtype, N, K, seed=2)), qtype, K, repacked)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, K, generator=g)
    bias = torch.randn(N, generator=g)
    full = quant.linear(x, w, qtype, bias, repacked)
    for M in MS:
        assert torch.equal(bits(quant.linear(x[:M].contiguous(), w, qtype, bias, repacked)), bits(full[:M])), f"M={M}"
    for r in (0, 5, 62, 63):
        assert torch.equal(bits(quant.linear(x[r:r + 1].contiguous(), w, qtype, bias, repacked)), bits(full[r:r + 1]))
    perm = torch.randperm(64, generator=g)
    assert torch.equal(bits(quant.linear(x[perm].contiguous(), w, qtype, bias, repacked)), bits(full[perm]))


def on_every_path(x: torch.Tensor, layouts, qtype: int) -> list[tuple[str, bool, torch.Tensor]]:
    """(path, repacked, y) for x against each (weight, repacked) layout on every path of this CPU."""
    outs = []
    try:
        for p in quant.paths():
            quant.set_path(p)
            outs += [(p, r, quant.linear(x, wl, qtype, repacked=r)) for wl, r in layouts]
    finally:
        quant.set_path(None)
    return outs


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_paths_agree_bit_for_bit(qtype):
    """Every path, and (32-value types) both layouts, give the same bits: the portable kernel
    on the rows as stored is the definition every repacked tile meets."""
    if len(quant.paths()) < 2:
        pytest.skip("one path on this CPU")
    N, K = shape(qtype, 301)
    w = torch.from_numpy(make_weights(qtype, N, K, seed=4))
    layouts = [(w, False)] + ([(layout(w, qtype, K, True), True)] if qtype in REPACKABLE else [])
    x = torch.randn(41, K, generator=torch.Generator().manual_seed(5))
    # the decode tiles (1-4 x rows against 4 or 8 weight rows), one-pass 5 to 8 rows, the batched ones;
    # 33 and 41: AMX's A tiles of 16 and 16 with a row on the AVX-512 tiles, and of 16, 16 and 9
    for M in (1, 2, 3, 4, 5, 6, 7, 17, 33, 41):
        outs = [y for _, _, y in on_every_path(x[:M].contiguous(), layouts, qtype)]
        for y in outs[1:]:
            assert torch.equal(bits(y), bits(outs[0])), f"M={M}"


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: T(t).name)
def test_paths_agree_bit_for_bit_at_the_integer_extremes(qtype):
    """Weights and activations at the ends of their ranges, where the SIMD tiles' int16 partial
    sums come nearest overflow (the AVX2 Q6_K tile's lane, sum (w - 32) x over 8 values, reaches
    -32 * 8 * 127; summed from zero, its products alone would pass 2^15): the portable kernel
    gets the exact sum, and every path and layout its bits."""
    N, K = 24, 512
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    x = torch.ones(6, K)
    x[1] = -1
    x[2].view(-1, 4)[:, 2:] = -1  # per 4 values +, +, -, -: a lane's pair all of one sign
    x[3].view(-1, 4)[:, :2] = -1
    x[4, ::2] = -1
    x[5] = torch.randn(K, generator=torch.Generator().manual_seed(13))
    x_hat, _ = quantize_x(x, qtype)
    for fill in (0x00, 0xFF):  # Q6_K: every weight -32 / 31; Q4_K, Q5_K: 0 / 15, 31 with scales and mins 63
        raw = np.full((N, K // bs, ts), fill, np.uint8)
        d_at = scale_at(qtype)
        raw[:, :, d_at:d_at + 2] = np.array([1e-3], np.float16).view(np.uint8)
        if qtype in WITH_MIN:
            raw[:, :, 2:4] = np.array([2e-3], np.float16).view(np.uint8)
        if qtype == T.Q6_K:  # the int8 scales at either end
            raw[0::2, :, 192:208] = np.array([-128], np.int8).view(np.uint8)
            raw[1::2, :, 192:208] = 127
        w = torch.from_numpy(raw.reshape(N, -1))
        Wd = torch.from_numpy(dequantize(w.numpy(), qtype))
        want = x_hat @ Wd.T
        layouts = [(w, False), (layout(w, qtype, K, True), True)]
        y = next(y for p, r, y in on_every_path(x, layouts[:1], qtype) if p == "portable")
        assert ((y.double() - want).abs() <= 1e-5 * want.abs().max()).all(), fill
        for M in (1, 4, 6):  # the 1-row and the 4-row tiles, and 4 + 2
            for p, r, got in on_every_path(x[:M].contiguous(), layouts, qtype):
                assert torch.equal(bits(got), bits(y[:M])), (p, M, r, fill)
        xs, ys = x.repeat(6, 1)[:33].contiguous(), y.repeat(6, 1)[:33]  # 33 rows: AMX's tiles (Q4_K, Q5_K)
        for p, r, got in on_every_path(xs, layouts, qtype):
            assert torch.equal(bits(got), bits(ys)), (p, 33, r, fill)


def hostile_activations(K: int, B: int, denormal: bool = False) -> torch.Tensor:
    """Rows of K values in blocks of B where quantising them is easiest to get wrong: ties (x * id
    exactly k + 0.5: max|x| = 127 * 2^e makes id = 2^-e), zeros of both signs, values near the top
    of fp32 and near the bottom of its normal range, one outlier over tiny values; with
    `denormal`, blocks whose max|x| is so small that 127 / max|x| overflows to infinity."""
    g = torch.Generator().manual_seed(21)
    rows = [torch.randn(K, generator=g)]
    for e in (0, -3, 5):  # ties, scaled exactly
        t = (torch.randint(-127, 127, (K,), generator=g).float() + 0.5) * 2.0 ** e
        t.view(-1, B)[:, 3] = -127 * 2.0 ** e
        rows.append(t)
    rows += [torch.zeros(K), torch.full((K,), -0.0)]
    mixed = torch.randn(K, generator=g)
    mixed.view(-1, B)[::2] = 0  # whole blocks of zeros between others
    rows.append(mixed)
    rows.append(torch.randn(K, generator=g) * 1e36)  # near fp32's largest (Q4_1's d * sum(q) stays finite)
    rows.append(torch.randn(K, generator=g) * 1e-36)  # 127 / max|x| just below fp32's largest
    outlier = torch.randn(K, generator=g) * 1e-6
    outlier[::B] = 1e4
    rows.append(outlier)
    if denormal:
        t = torch.randn(K, generator=g) * 1e-38
        t.view(-1, B)[1::2] *= 1e-3  # subnormal values only
        rows.append(t)
    return torch.stack(rows).contiguous()


def identity_weight(qtype: int, K: int) -> torch.Tensor:
    """W = I [K, K] in qtype's blocks (Q8_0, Q4_0, Q4_1), every weight exactly 0 or 1 with the
    scale 1: y = x W^T is each activation as the kernels quantise it, d_x * q rounded once to fp32."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((K, K // bs, ts), np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    for n in range(K):
        block, v = raw[n, n // bs], n % bs
        block[0:2] = one
        if qtype == T.Q8_0:
            block[2 + v] = 1
        elif qtype == T.Q4_0:  # value = nibble - 8; value v's nibble: byte v % 16, low half for v < 16
            block[2:] = 0x88
            block[2 + v % 16] = (block[2 + v % 16] & 0xF0) | 9 if v < 16 else (block[2 + v % 16] & 0x0F) | 0x90
        else:  # Q4_1: d * nibble + m, m = 0
            block[4 + v % 16] |= 1 if v < 16 else 0x10
    w = raw.reshape(K, -1)
    assert (dequantize(w, qtype) == np.eye(K)).all()
    return torch.from_numpy(w)


@pytest.mark.parametrize("qtype", (T.Q8_0, T.Q4_0, T.Q4_1), ids=lambda t: T(t).name)
def test_activations_are_quantised_as_defined(qtype):
    """Through W = I, every path and layout shows its activation quantisation (the portable
    path's quantize_row, the SIMD paths' own) value by value: exactly quantize_x's, on values
    where it is easiest to get wrong."""
    K = 352
    w = identity_weight(qtype, K)
    x = hostile_activations(K, 32)
    want = quantize_x(x, qtype)[0].float()
    for p, r, got in on_every_path(x, [(w, False), (layout(w, qtype, K, True), True)], qtype):
        assert torch.equal(got, want), (p, r)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in FLOATS], ids=lambda t: T(t).name)
def test_paths_agree_bit_for_bit_on_hostile_activations(qtype):
    """hostile_activations, subnormal blocks included, against random weights: every path and
    layout gives the portable kernel's bits."""
    N, K = shape(qtype, 24)
    w = torch.from_numpy(make_weights(qtype, N, K, seed=8))
    x = hostile_activations(K, 256 if qtype in K_QUANTS else 32, denormal=True)
    layouts = [(w, False)] + ([(layout(w, qtype, K, True), True)] if qtype in REPACKABLE else [])
    outs = on_every_path(x, layouts, qtype)
    want = next(y for p, r, y in outs if p == "portable" and not r)
    for p, r, got in outs:
        assert torch.equal(bits(got), bits(want)), (p, r)


@pytest.mark.parametrize("qtype", (T.Q4_K, T.Q5_K), ids=lambda t: T(t).name)
def test_amx_calls_of_many_rows(qtype):
    """More rows than one AMX call takes (the driver hands a group kAmxCallRows, 512, at a time):
    the same bits as the AVX-512 tiles, the rows of the second call included."""
    if "amx" not in quant.paths():
        pytest.skip("no AMX on this CPU")
    N, K = shape(qtype, 40)
    w = layout(torch.from_numpy(make_weights(qtype, N, K, seed=6)), qtype, K, True)
    x = torch.randn(530, K, generator=torch.Generator().manual_seed(7))
    outs = {}
    try:
        for p in ("avx512", "amx"):
            quant.set_path(p)
            outs[p] = quant.linear(x, w, qtype, repacked=True)
    finally:
        quant.set_path(None)
    assert torch.equal(bits(outs["amx"]), bits(outs["avx512"]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dequantize_rows_is_gguf_exactly(case):
    qtype, repacked = case
    N, K = shape(qtype)
    w_np = make_weights(qtype, N, K, seed=6)
    w = layout(torch.from_numpy(w_np), qtype, K, repacked)
    rows = torch.tensor([0, 36, 5, 5, 17, 31, 32], dtype=torch.int64)  # 31 | 32: the last grouped row, the first left
    got = quant.dequantize_rows(w, qtype, K, rows, repacked)
    want = torch.from_numpy(gguf.quants.dequantize(w_np, qtype).astype(np.float32))[rows]
    assert got.shape == (7, K)
    assert torch.equal(bits(got), bits(want))
    assert quant.dequantize_rows(w, qtype, K, torch.zeros(0, dtype=torch.int64), repacked).shape == (0, K)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
@pytest.mark.parametrize("N", [1, 7, 8, 37, 64])
def test_repack_round_trip(qtype, N):
    """as_stored(repack(t)) is t byte for byte; fewer rows than a group and types without a
    repacked layout stay as they are; a group's rows really are interleaved (row 1's scale
    sits right after row 0's)."""
    K = shape(qtype)[1]
    w = torch.from_numpy(make_weights(qtype, N, K, seed=8))
    t = QuantizedTensor(w, qtype, (N, K), T(qtype).name)
    r = quant.repack(t)
    if qtype not in REPACKABLE or N < 8:
        assert r is t
        return
    assert r.repacked and quant.repack(r) is r
    d_stored, d_grouped = scale_at(qtype), (1664 if qtype == T.Q6_K else 0)  # the 8 rows' fp16 scales side by side
    assert torch.equal(r.data.view(-1)[d_grouped + 2:d_grouped + 4], w[1, d_stored:d_stored + 2])
    back = quant.as_stored(r)
    assert not back.repacked and torch.equal(back.data, w)
    with pytest.raises(RuntimeError, match="no repacked layout"):
        quant.linear(torch.randn(1, 100), torch.from_numpy(make_weights(T.F16, 8, 100)), T.F16, repacked=True)
    with pytest.raises(ValueError, match="bytes for a"):  # data that does not match its shape is not read
        quant.repack(QuantizedTensor(w[:, :-1].contiguous(), qtype, (N, K), T(qtype).name))


def test_special_values_of_f16_scales():
    """Subnormal, zero and negative fp16 scales dequantise and multiply as gguf's numpy does."""
    K, N = 64, 4
    w = make_weights(T.Q8_0, N, K, seed=7)
    blocks = w.reshape(N, 2, 34)
    for i, h in enumerate((0x0001, 0x03ff, 0x8000, 0xbc00)):  # subnormals, -0, -1
        blocks[i, 0, :2] = np.array([h], dtype=np.uint16).view(np.uint8)
    want = dequantize(w, T.Q8_0)
    got = quant.dequantize_rows(torch.from_numpy(w), T.Q8_0, K, torch.arange(N))
    assert torch.equal(bits(got), bits(torch.from_numpy(want.astype(np.float32))))
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(11))
    y = quant.linear(x, torch.from_numpy(w), T.Q8_0).double()
    x_hat, step = quantize_x(x, T.Q8_0)
    w_hat = torch.from_numpy(want).double()
    # fp32 sums: the error is bounded relative to the sum of the terms' magnitudes, not the result's
    assert ((y - x_hat @ w_hat.T).abs() <= 1e-5 * (x_hat.abs() @ w_hat.abs().T) + 1e-30).all()


def test_edges():
    N, K = shape(T.Q4_0)
    w = torch.from_numpy(make_weights(T.Q4_0, N, K))
    assert quant.linear(torch.zeros(0, K), w, T.Q4_0).shape == (0, N)
    assert torch.equal(quant.linear(torch.zeros(2, K), w, T.Q4_0), torch.zeros(2, N))
    assert quant.block_size(T.Q4_K) == 256 and quant.row_bytes(T.Q4_K, 512) == 288
    assert quant.block_size(T.F16) == 1 and quant.row_bytes(T.BF16, 10) == 20


def test_bad_arguments_raise():
    N, K = shape(T.Q4_0)
    w = torch.from_numpy(make_weights(T.Q4_0, N, K))
    x = torch.randn(3, K)
    with pytest.raises(TypeError, match="float32"):
        quant.linear(x.double(), w, T.Q4_0)
    with pytest.raises(TypeError, match="uint8"):
        quant.linear(x, w.to(torch.int8), T.Q4_0)
    with pytest.raises(ValueError, match="2-D"):
        quant.linear(x[0], w, T.Q4_0)
    with pytest.raises(ValueError, match="contiguous"):
        quant.linear(torch.randn(K, 3).T, w, T.Q4_0)
    with pytest.raises(ValueError, match="contiguous"):
        quant.linear(x, w[:, :-2], T.Q4_0)  # a view with a row stride: not contiguous
    with pytest.raises(ValueError, match="bytes per row"):
        quant.linear(x, w[:, :-18].contiguous(), T.Q4_0)
    with pytest.raises(ValueError, match="bytes per row"):
        quant.linear(torch.randn(3, K - 32), w, T.Q4_0)
    with pytest.raises(ValueError, match="multiple"):
        quant.linear(torch.randn(3, K - 1), w, T.Q4_0)
    with pytest.raises(ValueError, match="outputs"):
        quant.linear(x, w, T.Q4_0, torch.zeros(N + 1))
    with pytest.raises(TypeError, match="float32"):
        quant.linear(x, w, T.Q4_0, torch.zeros(N, dtype=torch.float64))
    with pytest.raises(ValueError, match="no quantised kernel"):
        quant.linear(x, w, T.Q2_K)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quant.linear(x.numpy(), w, T.Q4_0)
    with pytest.raises(IndexError):
        quant.dequantize_rows(w, T.Q4_0, K, torch.tensor([0, N]))
    with pytest.raises(IndexError):
        quant.dequantize_rows(w, T.Q4_0, K, torch.tensor([-1]))
    with pytest.raises(TypeError, match="int64"):
        quant.dequantize_rows(w, T.Q4_0, K, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="bytes per row"):
        quant.dequantize_rows(w, T.Q4_0, K + 32, torch.tensor([0]))
    with pytest.raises(ValueError, match="unknown path"):
        quant.set_path("avx9000")


def test_a_bad_path_setting_is_one_line_at_load(default_gguf):
    # importing never reads it; the first load does, and the CLI prints that one line
    env = {**os.environ, "NANOINFER_QUANT_PATH": "bogus"}
    assert subprocess.run([sys.executable, "-c", "import nanoinfer.kernels.quant"], env=env, timeout=120).returncode == 0
    p = subprocess.run([sys.executable, "-m", "nanoinfer", "generate", "hi", "--model", str(default_gguf), "-n", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: NANOINFER_QUANT_PATH='bogus': unknown path")


def test_a_path_this_cpu_lacks_is_a_setting_error(monkeypatch):
    monkeypatch.setattr(quant, "paths", lambda: ["portable", "avx2"])
    monkeypatch.setattr(quant, "_path", None)
    monkeypatch.setenv("NANOINFER_QUANT_PATH", "avx512")
    with pytest.raises(SettingError, match="NANOINFER_QUANT_PATH='avx512': the path is not available on this CPU"):
        quant.current_path()
    with pytest.raises(SettingError, match="not available on this CPU"):
        quant.set_path("amx")
    monkeypatch.setenv("NANOINFER_QUANT_PATH", "avx2")
    assert quant.current_path() == quant._PATH_CODES["avx2"]


def test_path_from_the_environment(monkeypatch):
    N, K = shape(T.Q5_1)
    w = torch.from_numpy(make_weights(T.Q5_1, N, K))
    x = torch.randn(4, K)
    monkeypatch.setenv("NANOINFER_QUANT_PATH", "portable")
    quant.set_path(None)
    try:
        assert quant._path == 1
        y = quant.linear(x, w, T.Q5_1)
        quant.set_path("portable")
        assert torch.equal(bits(y), bits(quant.linear(x, w, T.Q5_1)))
        monkeypatch.setenv("NANOINFER_QUANT_PATH", "bogus")
        with pytest.raises(ValueError, match="NANOINFER_QUANT_PATH"):
            quant.set_path(None)
    finally:
        monkeypatch.delenv("NANOINFER_QUANT_PATH")
        quant.set_path(None)
    assert quant._path == 0


def test_parameters_and_default_dtype():
    """An nn.Parameter weight is a tensor like any other; the output is fp32 whatever torch's default dtype."""
    N, K = shape(T.Q8_0)
    w = torch.from_numpy(make_weights(T.Q8_0, N, K))
    x = torch.randn(2, K)
    want = quant.linear(x, w, T.Q8_0)
    assert torch.equal(quant.linear(x, torch.nn.Parameter(w, requires_grad=False), T.Q8_0), want)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        y = quant.linear(x, w, T.Q8_0)
    finally:
        torch.set_default_dtype(old)
    assert y.dtype == torch.float32 and torch.equal(y, want)



# The K-quants' tiles on the AVX-512 path come in two forms each. The one-group tiles keep each
# row's sums in a pair of 512-bit lanes (QG_PAIRED_LANES, the build on AMD's Zen 5) or run on
# 256-bit vectors (the build elsewhere); Q5_K's and Q6_K's 16-row tiles take up to 8 rows a pass
# where a call sweeps its weights from cache (QG_SWEPT_WIDE_TILE_ROWS=8 on Zen 5, or
# QG_WIDE_TILE_ROWS=8 on Intel) or up to 6. And swept calls take their weights in chunks of
# 16 rows or, on Zen 5, of up to 256 KiB (QG_SWEPT_CHUNK_BYTES). The tests above run this CPU's
# forms; the fixture builds the other ones.
def defined_here(name: str, default: str) -> str:
    """The value this CPU's build gives macro `name` (its last -D), else the header's default."""
    values = [f.partition("=")[2] for f in cpu_kernels._flags() if f.startswith(f"-D{name}=")]
    return values[-1] if values else default


PAIRED_HERE = defined_here("QG_PAIRED_LANES", "0") == "1"
SWEPT_EIGHT_HERE = defined_here("QG_SWEPT_WIDE_TILE_ROWS", defined_here("QG_WIDE_TILE_ROWS", "6")) == "8"
CHUNKED_HERE = int(defined_here("QG_SWEPT_CHUNK_BYTES", "0")) > 0


def other_form_build() -> kernel_builds.Build | None:
    """quant_gemm.cpp with the forms of those tiles this CPU's build leaves out (through SIMDe
    where the CPU lacks AVX-512), or None where that cannot be built here."""
    flags = "-UQG_PAIRED_LANES -DQG_PAIRED_LANES=0" if PAIRED_HERE else "-DQG_PAIRED_LANES=1"
    flags += (" -UQG_SWEPT_WIDE_TILE_ROWS -DQG_SWEPT_WIDE_TILE_ROWS=6" if SWEPT_EIGHT_HERE
              else " -DQG_SWEPT_WIDE_TILE_ROWS=8")
    flags += " -UQG_SWEPT_CHUNK_BYTES" if CHUNKED_HERE else " -DQG_SWEPT_CHUNK_BYTES=16384"
    if "avx512" not in quant.paths():
        if not kernel_builds.SIMDE_AVX512.exists():
            return None
        flags += " " + kernel_builds.EMULATED
    return kernel_builds.Build(flags, "quant_gemm.cpp")


def paths_to_emulate() -> bool:
    """This CPU lacks the AVX-512 or the AVX-VNNI path: the emulated library runs them here."""
    return not {"avx512", "avxvnni"} <= set(quant.paths())


def background_builds(names: set[str]) -> list[kernel_builds.Build]:
    """The builds of minutes this module's selected tests load (conftest.py starts them)."""
    builds = []
    if "test_simd_paths_through_emulation" in names and paths_to_emulate() and kernel_builds.SIMDE_AVX512.exists():
        builds.append(kernel_builds.EMULATED_LIBRARY)
    if "test_the_other_form_of_the_k_quant_tiles" in names and (build := other_form_build()) is not None:
        builds.append(build)
    return builds


@pytest.fixture(scope="module")
def other_k_quant_tiles():
    """csrc/quant_gemm.cpp built with the forms of those tiles this CPU's build leaves out."""
    build = other_form_build()
    if build is None:
        pytest.skip("no AVX-512 here and SIMDe's headers are missing (Debian: libsimde-dev)")
    return kernel_builds.built_with(build, cpu_kernels.declare_quant)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: T(t).name)
def test_the_other_form_of_the_k_quant_tiles(qtype, other_k_quant_tiles, monkeypatch):
    """The forms this CPU's build leaves out, on the AVX-512 path: close to the dequantised
    weights, a row's bits the same in any batch, and the portable kernel's bits, at every row
    count that takes the one-group tiles and at swept ones (17 rows and more) that take 8-row
    or 6-row passes, over chunks of weight rows sized in bytes or of 16 rows."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: other_k_quant_tiles)
    assert "avx512" in quant.paths()
    quant.set_path("avx512")
    try:
        test_matches_dequantised((qtype, True), "avx512")
        test_rows_do_not_depend_on_the_batch((qtype, True), "avx512", 37)
    finally:
        quant.set_path(None)
    test_paths_agree_bit_for_bit(qtype)
    test_paths_agree_bit_for_bit_at_the_integer_extremes(qtype)


def test_bench_linears_against_the_other_form(other_k_quant_tiles, default_gguf, capsys):
    """`bench linears --against` with a real second build (the other forms' flags: the fixture
    built it, so the bench finds it in the kernel cache): both builds run the default model's
    weights with the same bits, and the table gives both."""
    import json

    from nanoinfer.bench.cli import main

    flags = other_form_build().flags
    assert main(["linears", "--model", str(default_gguf), "--rows", "1,4", "--runs", "1", "--threads", "1",
                 f"--against={flags}"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["against"] == flags and {r["rows"] for r in doc["results"]} == {1, 4}
    assert all(r["against_seconds"] > 0 for r in doc["results"]) and "against / this" in out


def test_simd_paths_through_emulation():
    """On a CPU without AVX-512 or AVX-VNNI those paths still run, in a build where SIMDe's
    portable intrinsics stand in for AVX-512 and AVX2 code for AVX-VNNI's vpdpbusd
    (-DQG_EMULATE_AVX512): the kernel tests above, the decoder stack and batch invariance, all on
    them, in a fresh process. Their logic is checked wherever the suite runs; a CPU with both
    (a recent Xeon) runs the same tests natively."""
    import subprocess
    import sys

    if not paths_to_emulate():
        pytest.skip("this CPU runs the AVX-512 and AVX-VNNI paths natively: the tests above cover them")
    if not kernel_builds.SIMDE_AVX512.exists():
        pytest.skip("SIMDe's headers are missing (Debian: libsimde-dev; `make test` installs them as root)")
    kernel_builds.wait(kernel_builds.EMULATED_LIBRARY)  # (started when the session was collected)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "(avx512 or avxvnni or paths_agree) and not emulation",
         "tests/test_quant_kernels.py", "tests/test_decoder_stack.py", "tests/test_quant_path.py"],
        cwd=kernel_builds.ROOT, env=kernel_builds.env(kernel_builds.EMULATED), capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert " skipped" not in tail.splitlines()[-1], tail  # every selected test ran on the emulated path
