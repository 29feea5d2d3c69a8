"""Linears on GGUF weights kept in their blocks (csrc/quant_gemm.cpp): y = x W^T where W is
a tensor as a GGUF file stores it, [N, row_bytes] uint8, each row K / block_size blocks in
llama.cpp's layout. The types with kernels, their block sizes and activation formats are one
table that the C++ reads too: csrc/quant/types.def, parsed here at import (`RECORDS`). The
activations are quantised per block as llama.cpp does (q8_0 / q8_1 for the 32-value formats,
q8_K for the K-quants), so each block's dot product is an exact integer sum; F32, F16 and
BF16 weights meet the fp32 activations as they are (F32: an F32 file's experts, which the
routed-experts layer reads in place).

The block types run repacked (`repack`, at load; the record's `interleave`): rows in groups
of 8, each block of the 8 rows interleaved 4 values at a time (csrc/quant/packed.h), so the
kernels compute 8 outputs per vector. The mapped file stays the source; the repacked copy
replaces it in the model.

Each output row depends only on its own input row: the same bits alone or in any batch, and
the same bits on every path (`paths()`: "amx" where the CPU has AMX-TILE and AMX-INT8 beside
the AVX-512 path's features and Linux grants the tile registers, "avx512" where it has AVX-512
F/BW/VL and VNNI, "avxvnni" where it has AVX2+FMA+F16C and AVX-VNNI (the AVX2 block kernels with
VEX vpdpbusd), "avx2" where it has AVX2+FMA+F16C, "portable" everywhere). The fastest path
runs unless `set_path(name)` or NANOINFER_QUANT_PATH (read at the kernels' first use and by
`set_path(None)`) names one; an unknown name, or a path this CPU lacks, is a SettingError there,
so a load fails with one line before any request. "amx" hands Q4_K and Q5_K calls of 32 rows or
more (prefill chunks, decode batches of 32 and up) to the tile unit and runs everything else as
"avx512" does (csrc/quant/x86_amx.h).

Error against x @ dequantize(W).T (fp64): the activation rounding, at most half a step
d_x / 2 per value (d_x = max|x| / 127 over the value's block), times |w|, summed, plus fp32
rounding of the per-block sums (tests/test_quant_kernels.py checks both parts).
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import SettingError
from ..tensors import QuantizedTensor
from . import cpu_kernels
from .weight_memory import streamed_empty

T = GGMLQuantizationType
TYPES_DEF = cpu_kernels.CSRC / "quant" / "types.def"


@dataclass(frozen=True, slots=True)
class QuantType:
    """One record of csrc/quant/types.def (its comment says what each field means); the
    kernels' names stay on the C++ side."""
    name: str
    ggml: int            # GGML's type id
    block_values: int
    block_bytes: int
    acts: str            # the activations' format: f32, q8_0, q8_1, q8_K32, q8_K16
    interleave: int      # rows per group of its repacked layout (1: none)


def read_records(path: Path = TYPES_DEF) -> dict[int, QuantType]:
    """The records of a types.def, by GGML id: one `QUANT_TYPE(...)` a line, `//` comments."""
    records: dict[int, QuantType] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("//")[0].strip()
        if not code:
            continue
        match = re.fullmatch(r"QUANT_TYPE\((.*)\)", code)
        fields = [f.strip() for f in match.group(1).split(",")] if match else []
        if len(fields) != 8 or not all(f.isdigit() for f in (*fields[1:4], fields[5])):
            raise ValueError(f"{path}:{number}: not a record QUANT_TYPE(name, ggml, values, bytes, acts, interleave, "
                             f"dequantize, dot): {line!r}")
        record = QuantType(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), fields[4], int(fields[5]))
        if record.ggml in records:
            raise ValueError(f"{path}:{number}: a second record for GGML type {record.ggml}")
        records[record.ggml] = record
    return records


RECORDS = read_records()  # GGML id -> its record: the types with kernels
QUANT_TYPES: tuple[GGMLQuantizationType, ...] = tuple(t for t in T if t in RECORDS)  # the same, as gguf's enum
# PATH_* in csrc/quant_gemm.cpp; 0 = the fastest available
_PATH_CODES = {"portable": 1, "avx2": 2, "avxvnni": 3, "avx512": 4, "amx": 5}
PATH_NAMES = tuple(_PATH_CODES)  # every dispatch path, slowest first
_ERRORS = {-1: "no kernel for this type", -2: "path not available on this CPU", -3: "K is not a multiple of the block",
           -4: "a row index is out of range", -5: "the type has no repacked layout"}


def _path_code(name: str, setting: str) -> int:
    """The code of the path `setting` names, which must be known and, with the compiled library
    loaded, one this CPU runs."""
    if name not in _PATH_CODES:
        raise SettingError(f"{setting}{name!r}: unknown path; known paths are {list(_PATH_CODES)}")
    available = paths()
    if available and name not in available:
        raise SettingError(f"{setting}{name!r}: the path is not available on this CPU (available: {available})")
    return _PATH_CODES[name]


def _path_from_env() -> int:
    name = os.environ.get("NANOINFER_QUANT_PATH") or None
    return _path_code(name, "NANOINFER_QUANT_PATH=") if name else 0


_path: int | None = None  # the path code every call passes (current_path); None: the environment's, not read yet
_local = threading.local()  # each thread's argument array for quant_linear


def _sizes(qtype: int) -> tuple[str, int, int]:
    """Name, values and bytes per block: from the record, else (a type without a kernel) gguf's table."""
    r = RECORDS.get(qtype)
    if r is not None:
        return r.name, r.block_values, r.block_bytes
    return T(qtype).name, *GGML_QUANT_SIZES[T(qtype)]


def block_size(qtype: int) -> int:
    """Values per block (1 for F32/F16/BF16)."""
    return _sizes(qtype)[1]


def row_bytes(qtype: int, K: int) -> int:
    """Bytes of one weight row of K values."""
    name, bs, ts = _sizes(qtype)
    if K % bs:
        raise ValueError(f"K={K} is not a multiple of {name}'s block of {bs}")
    return K // bs * ts


def supported(qtype: int) -> bool:
    """A kernel exists for qtype and the compiled library loaded. (Loaders ask this of each
    weight, so it reads the path too: a bad NANOINFER_QUANT_PATH fails the load.)"""
    if qtype not in RECORDS or cpu_kernels.library() is None:
        return False
    current_path()
    return True


def paths(library: ctypes.CDLL | None = None) -> list[str]:
    """The paths this CPU runs ([] without the compiled library), in _PATH_CODES' order: the
    default (`default_path()`) is the last. `library`: a second build's (cpu_kernels.quant_library_with)."""
    lib = library or cpu_kernels.library()
    if lib is None:
        return []
    mask = lib.quant_paths()
    return [name for name, code in _PATH_CODES.items() if mask & (1 << code)]


def default_path() -> str | None:
    """The path that runs unless one is named: the fastest of this CPU's (None without the
    compiled library)."""
    lib = cpu_kernels.library()
    return None if lib is None else _path_name(lib.quant_default_path())


def _path_name(code: int) -> str | None:
    return next((name for name, c in _PATH_CODES.items() if c == code), None)


def set_path(name: str | None) -> None:
    """Run later calls on one path ("portable", "avx2", "avxvnni", "avx512", "amx"), or with None on the
    one that NANOINFER_QUANT_PATH names (read at the kernels' first use and here), else the fastest."""
    global _path
    _path = _path_code(name, "path ") if name else _path_from_env()


def dot_peak(budget_s: float = 0.3) -> float:
    """The 8-bit dot peak (integer ops/s, 2 per u8 x s8 product) of the current path on the
    threads torch uses: the best of repeated probes (csrc/quant_gemm.cpp: quant_dot_peak), the
    least disturbed by other work. 0.0 without the compiled library or a probe for the path.
    At least one probe long enough to time is taken, whatever the budget: a budget spent on
    probes too short to count (on a loaded machine) returned 0.0, read as "no probe"."""
    lib = cpu_kernels.library()
    if lib is None:
        return 0.0
    reps, best, start = 1 << 14, 0.0, time.perf_counter()
    while best == 0.0 or time.perf_counter() - start < budget_s:  # (reps grow until a probe is timed)
        t0 = time.perf_counter()
        ops = lib.quant_dot_peak(current_path(), reps)
        elapsed = time.perf_counter() - t0
        if ops < 0:
            return 0.0
        if elapsed < 0.02:  # too short to time: more rounds
            reps *= 4
            continue
        best = max(best, ops / elapsed)
    return best


def current_path() -> int:
    """The path code calls pass now (0: the fastest)."""
    global _path
    if _path is None:
        _path = _path_from_env()
    return _path


def path_name() -> str | None:
    """The name of the path calls run on now: the one named, else `default_path()`."""
    return _path_name(current_path()) or default_path()


def error_message(rc: int) -> str:
    return _ERRORS.get(rc, str(rc))


def _check(t: object, what: str, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what} must be on the CPU, not {t.device}")
    if t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, not {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{what} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _library(qtype: int):
    if qtype not in RECORDS:
        raise ValueError(f"no quantised kernel for GGML type {qtype}")
    lib = cpu_kernels.library()
    if lib is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (no compiler, or NANOINFER_CPU_KERNELS=0)")
    return lib


def _is(t: object, dtype: torch.dtype, dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is dtype and t.dim() == dim and t.is_contiguous() and t.is_cpu


def linear(x: torch.Tensor, w: torch.Tensor, qtype: int, bias: torch.Tensor | None = None,
           repacked: bool = False, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """F.linear(x, dequantize(w), bias) with w left in its blocks: x fp32 [M, K], w uint8
    [N, row_bytes(qtype, K)] (as stored, or in the repacked layout: `repacked`), bias fp32 [N]
    or None; returns fp32 [M, N]. `library`: a second build of the kernels to run instead of
    the library (cpu_kernels.quant_library_with).

    Called per layer per step, so the checks are one expression (a few microseconds count
    when a model has 200 linears); the slow path says what is wrong."""
    r = RECORDS.get(qtype)
    if not (r is not None and _is(x, torch.float32, 2) and _is(w, torch.uint8, 2)
            and (bias is None or (_is(bias, torch.float32, 1) and bias.shape[0] == w.shape[0]))):
        _explain(x, w, qtype, bias)
    M, K = x.shape
    N = w.shape[0]
    bs = r.block_values
    if K % bs or w.shape[1] != K // bs * r.block_bytes:
        raise ValueError(f"w has {w.shape[1]} bytes per row; {r.name} with K={K} needs "
                         + (f"{row_bytes(qtype, K)}" if K % bs == 0 else f"K a multiple of {bs}"))
    lib = library or cpu_kernels.library()
    if lib is None:
        raise RuntimeError("the compiled CPU kernels are unavailable (no compiler, or NANOINFER_CPU_KERNELS=0)")
    y = torch.empty(M, N, dtype=torch.float32)
    try:
        args, addr = _local.args
    except AttributeError:
        args = (ctypes.c_int64 * 10)()
        addr = ctypes.addressof(args)
        _local.args = args, addr
    args[:] = (qtype, current_path(), x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), M, K, N,
               int(repacked))
    rc = lib.quant_linear(addr)
    if rc:
        raise RuntimeError(f"quant_linear({r.name}): {_ERRORS.get(rc, rc)}")
    return y


def _explain(x, w, qtype, bias) -> None:
    """Raise the error that says why linear's arguments were refused."""
    _library(qtype)
    _check(x, "x", torch.float32, 2)
    _check(w, "w", torch.uint8, 2)
    if bias is not None:
        _check(bias, "bias", torch.float32, 1)
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} values for {w.shape[0]} outputs")
    raise AssertionError("unreachable: linear refused valid arguments")


def dequantize_rows(w: torch.Tensor, qtype: int, K: int, rows: torch.Tensor, repacked: bool = False) -> torch.Tensor:
    """Rows `rows` (int64) of w (uint8 [N, row_bytes(qtype, K)], as stored or repacked) as fp32
    [len(rows), K], exactly as gguf.quants.dequantize gives them: embedding lookups from
    quantised rows."""
    lib = _library(qtype)
    _check(w, "w", torch.uint8, 2)
    _check(rows, "rows", torch.int64, 1)
    if w.shape[1] != row_bytes(qtype, K):
        raise ValueError(f"w has {w.shape[1]} bytes per row; {RECORDS[qtype].name} with K={K} needs "
                         f"{row_bytes(qtype, K)}")
    out = torch.empty(rows.shape[0], K, dtype=torch.float32)
    if rows.numel() == 0:
        return out
    rc = lib.quant_dequantize_rows(int(qtype), w.data_ptr(), w.shape[0], K, int(repacked), rows.data_ptr(),
                                   rows.shape[0], out.data_ptr())
    if rc == -4:
        raise IndexError(f"row index out of range for {w.shape[0]} rows")
    if rc:
        raise RuntimeError(f"quant_dequantize_rows({RECORDS[qtype].name}): {_ERRORS.get(rc, rc)}")
    return out


def _relayout(t: QuantizedTensor, repacked: bool) -> QuantizedTensor:
    lib = _library(t.qtype)
    _check(t.data, "data", torch.uint8, 2)
    if tuple(t.data.shape) != (t.shape[0], row_bytes(t.qtype, t.shape[1])):
        raise ValueError(f"{t.type_name}: {list(t.data.shape)} bytes for a [{t.shape[0]}, {t.shape[1]}] weight")
    out = streamed_empty(t.data.shape, torch.uint8)
    rc = lib.quant_repack(int(t.qtype), t.data.data_ptr(), t.shape[0], t.shape[1], out.data_ptr(), int(not repacked))
    if rc:
        raise RuntimeError(f"quant_repack({t.type_name}): {_ERRORS.get(rc, rc)}")
    return QuantizedTensor(out, t.qtype, t.shape, t.type_name, repacked)


def repack(t: QuantizedTensor) -> QuantizedTensor:
    """t in its type's repacked layout (a copy), or t itself: already repacked, a type without
    one, fewer than one group of rows, or no compiled library."""
    r = RECORDS.get(t.qtype)
    if t.repacked or r is None or r.interleave == 1 or t.shape[0] < r.interleave or cpu_kernels.library() is None:
        return t
    return _relayout(t, True)


def as_stored(t: QuantizedTensor) -> QuantizedTensor:
    """t with its rows as the file stores them (a copy when repacked): what slicing rows or
    columns needs."""
    return _relayout(t, False) if t.repacked else t
