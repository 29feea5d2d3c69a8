"""Streamed weights (the block formats' repacked copies, the fp32 GEMM's panels) start on a
2 MiB boundary and take transparent huge pages where the OS gives them, with their bytes and
results unchanged."""
from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from nanoinfer.kernels import cpu_kernels, quant
from nanoinfer.kernels.weight_memory import HUGE_PAGE, streamed_empty
from nanoinfer.tensors import QuantizedTensor

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the kernels cannot be built here")


def huge_page_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps (None: no such file)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def assert_in_huge_pages(t: torch.Tensor) -> None:
    """Some of t's whole 2 MiB stretches in huge pages and nothing past its end; fewer than all
    where the OS found no free 2 MiB of memory. Skips where the OS gives no huge pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this OS gives no transparent huge pages")
    nbytes = t.numel() * t.element_size()
    kib = huge_page_kib(t.data_ptr())
    assert kib is not None and 0 < kib <= nbytes // HUGE_PAGE * HUGE_PAGE // 1024


def test_a_small_weight_stays_in_ordinary_memory():
    t = streamed_empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert huge_page_kib(t.data_ptr()) in (None, 0)


@needs_compiler
def test_a_repacked_block_weight_takes_huge_pages():
    N, K = 600, 4096  # Q8_0: 600 rows of 4352 bytes, 2.5 MiB
    W = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32)
    w = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(W, T.Q8_0)).view(np.uint8).reshape(N, -1))
    r = quant.repack(QuantizedTensor(w, T.Q8_0, (N, K), "Q8_0"))
    assert r.repacked and r.data.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(quant.as_stored(r).data, w)
    x = torch.randn(3, K)
    assert torch.equal(quant.linear(x, r.data, T.Q8_0, repacked=True),
                       quant.linear(x, r.data.clone(), T.Q8_0, repacked=True))
    assert_in_huge_pages(r.data)


@needs_compiler
@pytest.mark.parametrize("N", [640, 650])  # whole panels, or a last panel of 10 rows
def test_packed_fp32_panels_take_huge_pages(N):
    K = 1024  # 2.5 MiB of fp32
    w = torch.randn(N, K)
    packed = cpu_kernels.pack_f32(w)
    assert packed.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(cpu_kernels.unpack_f32(packed), w)
    x = torch.randn(5, K)
    assert torch.equal(cpu_kernels.linear_packed_f32(x, packed, None),
                       cpu_kernels.linear_packed_f32(x, packed.clone(), None))
    assert_in_huge_pages(packed)
