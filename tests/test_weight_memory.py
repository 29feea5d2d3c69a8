"""Streamed weights (the block formats' repacked copies, the fp32 GEMM's panels) start on a
2 MiB boundary and take transparent huge pages where the OS gives them, with their bytes and
results unchanged."""
from __future__ import annotations

import gc
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from nanoinfer.kernels import cpu_kernels, quant, weight_memory
from nanoinfer.kernels.weight_memory import HUGE_PAGE, streamed_empty
from nanoinfer.tensors import QuantizedTensor

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the kernels cannot be built here")


@dataclass
class Mapping:
    """One mapping of /proc/self/smaps: its bounds and its fields (name -> the rest of the line)."""
    lo: int
    hi: int
    fields: dict[str, str]

    def holds(self, address: int) -> bool:
        return self.lo <= address < self.hi


def mapping_of(address: int) -> Mapping | None:
    """The mapping that holds `address` (None: no such mapping, or no /proc/self/smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
            if found is not None:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                found = Mapping(lo, hi, {})
        elif found is not None:
            found.fields[head.rstrip(":")] = rest.strip()
    return found


def huge_page_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` (None: no such mapping)."""
    m = mapping_of(address)
    return None if m is None else int(m.fields["AnonHugePages"].split()[0])


def assert_in_huge_pages(t: torch.Tensor, whole_pages: bool = True) -> None:
    """t's memory in huge pages where the OS gives them (some: fewer where it found no free
    2 MiB). whole_pages: t has a mapping of its own, and no huge page lies past its end. Skips
    where the OS gives no huge pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this OS gives no transparent huge pages")
    kib = huge_page_kib(t.data_ptr())
    assert kib is not None and kib > 0
    if whole_pages:
        assert kib <= t.numel() * t.element_size() // HUGE_PAGE * HUGE_PAGE // 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_small_weights_are_cut_from_shared_huge_page_chunks():
    """Weights under 2 MiB come one after another from 2 MiB-aligned chunks, each on a cache
    line of its own, never overlapping; a retired chunk lives as long as a tensor cut from it,
    and goes back to the OS with the last of them."""
    first = streamed_empty((1000, 3), torch.float32)
    second = streamed_empty((7,), torch.uint8)
    assert first.data_ptr() % 64 == 0 and second.data_ptr() % 64 == 0
    assert second.data_ptr() >= first.data_ptr() + first.numel() * 4 or second.data_ptr() + 7 <= first.data_ptr()
    first.fill_(1.5)
    second.fill_(9)
    chunk = mapping_of(first.data_ptr())
    assert chunk is not None and chunk.holds(second.data_ptr())
    later = None
    for _ in range(weight_memory.CHUNK // (HUGE_PAGE // 2) + 1):  # past the end of first's chunk
        later = streamed_empty((HUGE_PAGE // 2,), torch.uint8)
    assert later is not None and not chunk.holds(later.data_ptr())
    gc.collect()
    assert bool((first == 1.5).all()) and bool((second == 9).all())
    assert_in_huge_pages(first, whole_pages=False)
    del first, second
    gc.collect()
    after = mapping_of(chunk.lo)
    assert after is None or (after.lo, after.hi) != (chunk.lo, chunk.hi)


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
