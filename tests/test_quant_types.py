"""The quant type records (csrc/quant/types.def), one per type, read by the C++ and by
nanoinfer/kernels/quant.py: every record's sizes against the gguf package's table, the compiled
library's reading against Python's, and a toy type added as docs/architecture.md says ("How to
add a quant type": one record plus its kernels, nothing else) and run through quant.linear and
quant.dequantize_rows on every path.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

import kernel_builds
from nanoinfer.kernels import cpu_kernels, quant


def test_every_record_matches_gguf():
    """A real type's record says what GGML says: name, values and bytes per block."""
    assert len(quant.RECORDS) >= 10
    for r in quant.RECORDS.values():
        t = T(r.ggml)
        assert r.name == t.name
        assert (r.block_values, r.block_bytes) == GGML_QUANT_SIZES[t], r.name
        assert quant.block_size(t) == r.block_values and quant.row_bytes(t, 256) == 256 // r.block_values * r.block_bytes
    assert set(quant.QUANT_TYPES) == set(quant.RECORDS)


def _library_records(lib) -> list[tuple[int, int, int, int]]:
    out = (ctypes.c_int64 * 4 * 64)()
    n = lib.quant_types(out, 64)
    assert 0 < n <= 64
    return [tuple(out[i]) for i in range(n)]


def test_the_library_reads_the_same_records():
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no compiled kernels here")
    assert _library_records(lib) == [(r.ggml, r.block_values, r.block_bytes, r.interleave) for r in quant.RECORDS.values()]


def test_a_bad_record_is_named(tmp_path):
    bad = tmp_path / "types.def"
    bad.write_text("// a comment\nQUANT_TYPE(Q4_0, 2, 32, 18, q8_0, 8, dequantize32<Q4_0>, dot32<Q4_0>)\n"
                   "QUANT_TYPE(Q4_1, 3, 32, q8_1, 8, dequantize32<Q4_1>, dot32<Q4_1>)\n")
    with pytest.raises(ValueError, match=r"types.def:3: not a record"):
        quant.read_records(bad)
    bad.write_text("QUANT_TYPE(A, 2, 32, 18, q8_0, 1, a, b)\nQUANT_TYPE(B, 2, 32, 20, q8_1, 1, c, d)\n")
    with pytest.raises(ValueError, match=r"types.def:2: a second record for GGML type 2"):
        quant.read_records(bad)


# ---- a toy type, added the documented way ------------------------------------------------
# Shaped like a K-quant (256-value super-blocks, q8_K activations) with a size of its own:
# [d: fp16][q: int8 x 256], w = d * q. An id GGML does not use, so gguf's table does not
# check it (nor could it: it is no GGML type).
TOY = 1000
TOY_RECORD = "QUANT_TYPE(TOY_K, 1000, 256, 258, q8_K32, 1, dequantize_toy, dot_toy)\n"
TOY_KERNELS = """
// TOY_K [d: fp16][q: int8 x 256]: w = d * q.
namespace {
void dequantize_toy(const uint8_t* b, float* out) {
    const float d = f16(rd16(b));
    for (int i = 0; i < 256; i++) out[i] = d * float(int8_t(b[2 + i]));
}

// Per block the exact integer sum, then one fused multiply-add by d_w * d_x.
float dot_toy(const uint8_t* w, int64_t nb, const ActsRow& x) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * block_bytes(TOY_K);
        int32_t sum = 0;
        for (int i = 0; i < 256; i++) sum += int8_t(blk[2 + i]) * x.q[b * 256 + i];
        acc = madd(f16(rd16(blk)) * x.d[b], float(sum), acc);
    }
    return acc;
}
}  // namespace
"""


@functools.cache
def toy_csrc() -> Path:
    """A copy of csrc/ with the toy added in the two places the docs name: its record appended to
    quant/types.def, its kernels to quant/portable.h (one per process, removed at its exit)."""
    root = Path(tempfile.mkdtemp(prefix="nanoinfer-toy-"))
    atexit.register(shutil.rmtree, root, True)
    csrc = root / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    with open(csrc / "quant" / "types.def", "a") as f:
        f.write(TOY_RECORD)
    with open(csrc / "quant" / "portable.h", "a") as f:
        f.write(TOY_KERNELS)
    return csrc


# Only quant_gemm.cpp, at -O1 (the last -O wins): the toy's tests check records and bits, not
# speed, and the file's AVX tiles take a third of -O3's time to compile. Cached by content like
# the real library: built once per machine.
def toy_build() -> kernel_builds.Build:
    return kernel_builds.Build("-O1", "quant_gemm.cpp", toy_csrc())


def background_builds(names: set[str]) -> list[kernel_builds.Build]:
    """The toy's build, where a selected test loads it (conftest.py starts it)."""
    return [toy_build()] if any("toy" in n for n in names) and cpu_kernels.enabled() else []


@pytest.fixture(scope="module")
def toy_library():
    """The quant kernels built from toy_csrc()."""
    compiler = cpu_kernels.find_compiler()
    if compiler is None or not cpu_kernels.enabled():
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    build = toy_build()
    return kernel_builds.built_with(build, cpu_kernels.declare_quant), quant.read_records(build.csrc / "quant" / "types.def")


@pytest.fixture
def toy(toy_library, monkeypatch):
    """quant.py running on the toy's library and its records."""
    lib, records = toy_library
    monkeypatch.setattr(cpu_kernels, "library", lambda: lib)
    monkeypatch.setattr(quant, "RECORDS", records)
    yield
    quant.set_path(None)


def toy_weights(N: int, K: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.empty((N, K // 256, 258), np.uint8)
    d = (rng.standard_normal((N, K // 256)) * 1e-2).astype(np.float16)
    d[0, 0] = 0
    blocks[:, :, :2] = d.view(np.uint8).reshape(N, K // 256, 2)
    blocks[:, :, 2:] = rng.integers(-128, 128, (N, K // 256, 256)).astype(np.int8).view(np.uint8)
    return blocks.reshape(N, -1)


def toy_dequantize(w: np.ndarray) -> np.ndarray:
    N = w.shape[0]
    blocks = w.reshape(N, -1, 258)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return (d * q).reshape(N, -1)  # exact: 11 x 8 bits


def test_toy_record_is_read_by_both_sides(toy_library):
    lib, records = toy_library
    assert records[TOY] == quant.QuantType("TOY_K", TOY, 256, 258, "q8_K32", 1)
    assert _library_records(lib) == [(r.ggml, r.block_values, r.block_bytes, r.interleave) for r in records.values()]
    assert TOY not in {int(t) for t in T}  # no GGML type: exempt from gguf's table


def test_toy_runs_through_quant_linear(toy):
    N, K = 37, 768
    w_np = toy_weights(N, K)
    w = torch.from_numpy(w_np)
    assert quant.supported(TOY) and quant.block_size(TOY) == 256 and quant.row_bytes(TOY, K) == 3 * 258
    # dequantize_rows: exactly d * q
    rows = torch.tensor([0, 36, 5, 5])
    got = quant.dequantize_rows(w, TOY, K, rows)
    assert torch.equal(got, torch.from_numpy(toy_dequantize(w_np))[rows])
    # linear: x quantised per 256 values as q8_K, one fp32 multiply-add per block
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, K, generator=g) * torch.rand(9, 1, generator=g) * 3
    bias = torch.randn(N, generator=g)
    xb = x.reshape(9, -1, 256)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax * torch.tensor(np.float32(1) / np.float32(127))
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros(()))).clamp(-127, 127)
    Wd = torch.from_numpy(toy_dequantize(w_np)).double()
    x_hat = (q.double() * d.double()).reshape(9, K)
    want = x_hat @ Wd.T + bias.double()
    tol = 8 * 2.0 ** -24 * (x_hat.abs() @ Wd.abs().T + bias.double().abs())
    outs = {}
    for path in quant.paths():  # a path without a kernel for the type runs its portable dot
        quant.set_path(path)
        y = quant.linear(x, w, TOY, bias)
        assert ((y.double() - want).abs() <= tol).all(), path
        for m in (0, 4, 8):  # a row alone: the same bits as in the batch
            assert torch.equal(quant.linear(x[m:m + 1].contiguous(), w, TOY, bias), y[m:m + 1])
        outs[path] = y
    assert all(torch.equal(y, outs["portable"]) for y in outs.values())
    with pytest.raises(ValueError, match="TOY_K with K=512 needs 516"):
        quant.linear(torch.randn(2, 512), w, TOY)
