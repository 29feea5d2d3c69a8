"""Memory for the weights that the kernels stream once a step: the block formats' repacked
copies (quant.repack) and the fp32 GEMM's panels (cpu_kernels.pack_f32).

Such a weight is read end to end every decode step. In 4 KiB pages every page of it missed
the TLB every step, and on the 2-vCPU Zen 4 of docs/benchmarks.md (the eighteenth section)
a process holding its weights that way also slowed a neighbouring llama.cpp by up to ~10%.
So a weight of 2 MiB or more gets a private anonymous mapping, starts on a 2 MiB boundary
and has its whole 2 MiB stretches advised into transparent huge pages before its first
write (Linux's THP mode `madvise`, many distributions' default, gives them only on request).
The tail past the last whole stretch is advised to keep 4 KiB pages, so no page holds more
than the weight, also under THP mode `always`.

oneDNN's bf16 weights (cpu_linear) are allocated inside oneDNN and stay where it puts them.
"""
from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20


def streamed_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor for a streamed weight (see the module's docstring)."""
    shape = torch.Size(shape)
    n = shape.numel() * dtype.itemsize
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one is shmem: no THP)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    whole = n - n % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, start, whole)
    buf.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(buf) - start - whole)
    return torch.frombuffer(buf, dtype=dtype, count=shape.numel(), offset=start).view(shape)  # keeps the mapping alive
