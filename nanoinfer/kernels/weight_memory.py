"""Memory for the weights that the kernels stream once a step: the block formats' repacked
copies (quant.repack) and the fp32 GEMM's panels (cpu_kernels.pack_f32).

Such a weight is read end to end every decode step. In 4 KiB pages every page of it missed
the TLB every step, and on the 2-vCPU Zen 4 of docs/benchmarks.md (the eighteenth section)
a process holding its weights that way also slowed a neighbouring llama.cpp by up to ~10%.
So streamed weights live in private anonymous mappings whose 2 MiB stretches are advised
into transparent huge pages before their first write (Linux's THP mode `madvise`, many
distributions' default, gives them only on request):

- a weight of 2 MiB or more gets a mapping of its own, from a 2 MiB boundary; the tail past
  its last whole stretch is advised to keep 4 KiB pages, so no page holds more than the
  weight, also under THP mode `always`;
- smaller ones (a small model's every projection) are cut one after another from shared
  32 MiB chunks, each on a cache line of its own. A chunk is returned to the OS when the last
  tensor cut from it is freed; its untouched end is never resident, and the stretch in use
  when it ends holds at most 2 MiB that no weight uses.

oneDNN's bf16 weights (cpu_linear) are allocated inside oneDNN and stay where it puts them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 << 20
CHUNK = 16 * HUGE_PAGE
_ALIGN = 64


@dataclass
class _Chunk:
    buffer: mmap.mmap
    next: int  # offset of the next free byte
    end: int


_lock = threading.Lock()
_current: _Chunk | None = None


def _huge_mapping(n: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with room for n bytes from a 2 MiB boundary: (it, that offset)."""
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one is shmem: no THP)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    whole = n - n % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, start, whole)
    buf.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(buf) - start - whole)
    return buf, start


def streamed_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor for a streamed weight (see the module's docstring)."""
    global _current
    shape = torch.Size(shape)
    n = shape.numel() * dtype.itemsize
    if n == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    if n >= HUGE_PAGE:
        buf, start = _huge_mapping(n)
    else:
        with _lock:
            if _current is None or _current.next + n > _current.end:
                buf, start = _huge_mapping(CHUNK)
                _current = _Chunk(buf, start, start + CHUNK)
            buf, start = _current.buffer, _current.next
            _current.next += -(-n // _ALIGN) * _ALIGN
    return torch.frombuffer(buf, dtype=dtype, count=shape.numel(), offset=start).view(shape)  # keeps the mapping alive


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)  # glibc's; other C libraries go without


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), before a model's
    weights are laid out. A loader's buffers, once freed, stay resident in the heap; weights
    copied into the mappings above never reuse them, so without this the default model's load
    peaked ~23 MiB higher (docs/benchmarks.md, the nineteenth Zen 4 section)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
