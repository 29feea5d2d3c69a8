"""nanoinfer's compiled CPU kernels (csrc/*.cpp), built once per machine with the system
C++ compiler and called through ctypes.

- `paged_decode` (csrc/paged_attention.cpp): decode attention reading the KV blocks in
  place. The PyTorch path copies every decode row's blocks into one padded tensor per
  layer before attending; on a CPU that copy moves as many bytes as the attention reads.
- `linear_packed_f32` (csrc/packed_gemm.cpp): fp32 y = x w^T from a weight reordered once
  at load (`pack_f32`); at decode batch sizes MKL's sgemm spends more time repacking the
  weight on every call than computing.
- `decoder_stack` (csrc/decoder_stack.cpp): a Llama-family model's layers in one call, on
  weights in their GGUF blocks; nanoinfer/kernels/decoder_stack.py calls it.
- `routed_experts` (csrc/routed_experts.cpp): a mixture-of-experts layer's router and experts
  (in GGUF blocks) in one call; nanoinfer/kernels/routed_experts.py calls it.
- `rms_norm_*`, `rope_*`, `silu_mul_*` (csrc/layer_ops.cpp): a decoder layer's small ops in
  one pass each, fp32 and bf16; nanoinfer/kernels/layer_ops.py calls them.
- `quant_linear`, `quant_dequantize_rows` (csrc/quant_gemm.cpp, the types' records and
  kernels in csrc/quant/): y = x W^T with W kept in its GGUF blocks (Q8_0 ... Q6_K, F16, BF16);
  nanoinfer/kernels/quant.py calls them.
- `sample_draw`, `top_logprobs` (csrc/sampling.cpp): a sampled row's token in a few passes
  over its logits, certified equal to the reference definition's or left to it, and the
  logprobs' ranks and top tokens; nanoinfer/kernels/sampling.py calls them.

They need no torch headers, so they build in about a second on first use, into
~/.cache/nanoinfer/kernels. Without a compiler (or with NANOINFER_CPU_KERNELS=0) the
PyTorch paths run; kernels and PyTorch paths are tested against each other.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

from ..errors import SettingError
from ..user_cache import user_cache_dir
from .weight_memory import streamed_empty

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "packed_gemm.cpp", "layer_ops.cpp", "quant_gemm.cpp",
                                    "decoder_stack.cpp", "sampling.cpp", "routed_experts.cpp")]
# -ffast-math lets the dot products and sums vectorise; infinities stay (the softmax max starts at -inf).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-fPIC"]
# No VNNI from the auto-vectoriser: on a CPU with it, GCC 12 turned a plain int8 x int8 dot-product
# loop into vpdpbusd (u8 x s8) and got it wrong (tests/test_quant_types.py's toy type, an Intel
# Xeon with AVX-512 VNNI). The AVX-512 kernels ask for VNNI in their own target attributes.
NO_AUTO_VNNI = ["-mno-avxvnni", "-mno-avx512vnni"] if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else []


def _split(flags: str, what: str) -> list[str]:
    try:
        return shlex.split(flags)
    except ValueError as e:  # an unclosed quote
        raise SettingError(f"{what}: {str(e).lower()}") from None


def _flags(added: str = "") -> list[str]:
    """FLAGS, the tuning for this CPU's vendor, plus $NANOINFER_CXXFLAGS (the tests build with
    -DQG_EMULATE_AVX512 to run the AVX-512 path through SIMDe on CPUs without it), plus `added`
    (a second build beside the library: quant_library_with)."""
    extra = _split(os.environ.get("NANOINFER_CXXFLAGS", ""), "NANOINFER_CXXFLAGS") + _split(added, "the added flags")
    # (SIMDe's emulated AVX-512 maps to the native instructions the compiler may use: left as is)
    return FLAGS + ([] if "-DQG_EMULATE_AVX512" in extra else NO_AUTO_VNNI) + _vendor_flags() + extra


def first_processor(cpuinfo: str | None = None) -> dict[str, str]:
    """The fields of the first processor's block of /proc/cpuinfo (or of the text given): every
    processor of a machine shares its vendor, family and name. Empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _vendor_flags(cpuinfo: str | None = None) -> list[str]:
    """The kernels' tuning for this CPU's vendor and family, as measured on them
    (csrc/quant/kernel.h, csrc/paged_attention.cpp): on Intel a weight streamed one group at a
    time is prefetched 24 KiB ahead instead of 8 (kPrefetchOneGroup) into L2, and 4 KiB ahead
    into L1 (kPrefetchNear), decode attention runs on 512-bit vectors where the build has
    AVX-512 (PA_WIDE_VECTORS), the AVX-512 path's Q5_K and Q6_K tiles take up to 8 rows in one
    pass instead of 6 (kWideTileRows), and the K-quants' calls of 1-3 rows take its 256-bit tiles,
    one group prefetched at two distances (kNarrowTileRows, kNarrowType); on AMD family 25 (Zen 3
    and 4) the streamed weights are prefetched into L2 rather than L1 (kPrefetchLocality), and
    calls of one row take the AVX-512 path's 256-bit tiles (kNarrowTileRows: Zen 4's AVX-512 runs
    as two 256-bit halves); on Zen 4 (family 25 with AVX-512) Q8_0's and Q4_K's one-group streams
    are left to the hardware prefetcher (kHardwarePrefetched: a bit per GGML type id); on AMD
    family 26 (Zen 5; measured on an EPYC, whose 512-bit datapath is full width) decode attention
    runs on 512-bit vectors, calls of one row take the 256-bit tiles, the K-quant tiles spread
    a block's prefetches over its steps (kSpreadPrefetch), and the K-quants' one-group tiles run
    on 512-bit vectors with a row's sums in a pair of lanes, for calls of up to 4 rows
    (kPairedTile), and the AVX-512 path's Q5_K and Q6_K tiles take up to 8 rows in one pass where a
    call sweeps its weights from cache (prefill; kSweptWideTileRows), 6 where it streams them, and
    such calls take their weights in chunks of up to 256 KiB (kSweptChunkBytes) rather than 16
    rows."""
    cpu = first_processor(cpuinfo)
    vendor, family = cpu.get("vendor_id"), cpu.get("cpu family")
    if vendor == "GenuineIntel":
        k_quants = 1 << GGMLQuantizationType.Q4_K | 1 << GGMLQuantizationType.Q5_K | 1 << GGMLQuantizationType.Q6_K
        return ["-DQG_PREFETCH_ONE_GROUP=24576", "-DQG_PREFETCH_NEAR=4096", "-DPA_WIDE_VECTORS", "-DQG_WIDE_TILE_ROWS=8",
                "-DQG_NARROW_TILE_ROWS=3", f"-DQG_NARROW_TYPES={k_quants}"]
    if vendor == "AuthenticAMD" and family == "25":
        zen4 = "avx512f" in cpu.get("flags", "").split()
        return ["-DQG_PREFETCH_LOCALITY=2", "-DQG_NARROW_TILE_ROWS=1"] + (
            [f"-DQG_UNPREFETCHED_TYPES={1 << GGMLQuantizationType.Q8_0 | 1 << GGMLQuantizationType.Q4_K}"] if zen4 else [])
    if vendor == "AuthenticAMD" and family == "26":
        return ["-DPA_WIDE_VECTORS", "-DQG_NARROW_TILE_ROWS=1", "-DQG_SPREAD_PREFETCH=1", "-DQG_PAIRED_LANES=1",
                "-DQG_SWEPT_WIDE_TILE_ROWS=8", "-DQG_SWEPT_CHUNK_BYTES=262144"]
    return []


# (query dtype, cache dtype) -> entry point; fp32 queries over a bf16 cache: the block-format path
DECODE_ENTRY_POINTS = {(torch.float32, torch.float32): "paged_decode_f32", (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
                       (torch.float32, torch.bfloat16): "paged_decode_f32_bf16kv",
                       (torch.float32, torch.uint8): "paged_decode_f32_q8kv"}  # uint8: q8_0 blocks
LAYER_OP_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # csrc/layer_ops.cpp: rms_norm_f32, ...


def enabled() -> bool:
    return os.environ.get("NANOINFER_CPU_KERNELS", "1") != "0"


def _cpu_id() -> str:
    """The CPU's name and feature flags: -march=native code must not run on another CPU
    that shares the cache directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        import platform
        return platform.processor() + platform.machine()


def _compile(compiler: str, out: Path, sources: list[Path], added: str = "") -> str | None:
    """Build to a temporary name and rename (another process may build the same file at
    once). OpenMP when the compiler has it, else one thread. Returns an error or None.

    Compiled with -ffast-math, linked without it: a shared object linked with -ffast-math
    carries crtfastmath, which sets flush-to-zero for the whole process when loaded, and
    then Python itself reads 1e-310 as 0.0 and torch flushes every subnormal."""
    err: str | None = ""
    with tempfile.TemporaryDirectory(dir=out.parent) as build:
        for extra in (["-fopenmp"], []):
            objects = [str(Path(build) / f"{src.stem}.o") for src in sources]
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            # the sources compile at once, one per core (the first build is most of a fresh set-up)
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                errors = list(pool.map(_run, [[compiler, *_flags(added), *extra, "-c", str(src), "-o", obj]
                                              for src, obj in zip(sources, objects)]))
            err = next((e for e in errors if e is not None), None)
            if err is None:
                err = _run([compiler, "-shared", *extra, *objects, "-o", tmp])
            if err is None:
                os.replace(tmp, out)
                return None
            os.unlink(tmp)
    return err


def _run(cmd: list[str]) -> str | None:
    """A compiler command; its last error line, or None when it succeeded."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"


def find_compiler() -> str | None:
    """$CXX, else the system's C++ compiler."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build(compiler: str, csrc: Path, sources: list[Path], added: str = "") -> tuple[Path, str | None]:
    """The shared object built from `sources` (with the flags `added` to _flags'), from the cache
    when built before: keyed by every file under `csrc` (the headers, quant/types.def: a change to
    any of them builds anew), the flags, the compiler and the CPU. Returns its path and None, or
    an error. (A test builds a copy of csrc/ with a quant type added this way.)"""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    files = sorted(p for p in csrc.rglob("*") if p.is_file())
    text = [f"{p.relative_to(csrc)}\0{p.read_text()}" for p in files] + [str(s.relative_to(csrc)) for s in sources]
    key = hashlib.sha256("\0".join([*text, *_flags(added), "link-separately", compiler, version, _cpu_id()]).encode())
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    try:
        path = user_cache_dir() / "kernels" / name
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable cache (a read-only home): build for this process only, in a private dir
        path = Path(tempfile.mkdtemp(prefix="nanoinfer-kernels-")) / name
    if path.exists():
        return path, None
    # a first run on this machine: tens of seconds, say so
    print(f"nanoinfer: building the CPU kernels for this machine (once; cached in {path.parent}) ...",
          file=sys.stderr, flush=True)
    return path, _compile(compiler, path, sources, added)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (with one line on stderr saying why) if they cannot be had."""
    if not enabled():
        return None
    compiler = find_compiler()
    if compiler is None:
        print("nanoinfer: no C++ compiler found; the CPU runs the slower PyTorch paths", file=sys.stderr)
        return None
    try:
        try:
            path, err = build(compiler, CSRC, SOURCES)
        except SettingError as e:  # flags that do not parse: as flags the compiler refuses
            path, err = None, str(e)
        if err:
            print(f"nanoinfer: building the CPU kernels failed ({err}); using the PyTorch paths", file=sys.stderr)
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        print(f"nanoinfer: the CPU kernels are unavailable ({e}); using the PyTorch paths", file=sys.stderr)
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    declare_attention(lib)
    lib.decoder_stack.argtypes = [p, p]  # structures: kernels/decoder_stack.py
    lib.decoder_stack.restype = ctypes.c_int
    lib.routed_experts.argtypes = [p, i, p, i, p, p, p]  # the layer's structure: kernels/routed_experts.py
    lib.routed_experts.restype = ctypes.c_int
    lib.linear_packed_f32.argtypes = [p, p, p, p, i, i, i]
    lib.linear_packed_f32.restype = None
    declare_quant(lib)
    declare_sampling(lib)
    for suffix in LAYER_OP_SUFFIXES.values():
        getattr(lib, f"rms_norm_{suffix}").argtypes = [p, p, p, p, i, i, ctypes.c_float]
        getattr(lib, f"rope_{suffix}").argtypes = [p, i, p, p, p, i, i, i]
        getattr(lib, f"silu_mul_{suffix}").argtypes = [p, p, i, i]
        getattr(lib, f"gelu_tanh_mul_{suffix}").argtypes = [p, p, i, i]
        for op in ("rms_norm", "rope", "silu_mul", "gelu_tanh_mul"):
            getattr(lib, f"{op}_{suffix}").restype = None
    return lib


def quant_library_with(flags: str) -> ctypes.CDLL:
    """csrc/quant_gemm.cpp (the block GEMM's entry points) built with `flags` added to the
    library's, loaded beside it: a kernel change against the kernels as built, in one process
    (`bench linears --against`), where alternating processes would compare two moments of a
    noisy host. Raises SettingError when it cannot be built or loaded."""
    compiler = find_compiler()
    if compiler is None:
        raise SettingError("no C++ compiler found")
    path, err = build(compiler, CSRC, [CSRC / "quant_gemm.cpp"], flags)
    if err:
        raise SettingError(f"building the kernels with {flags!r} added failed: {err}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise SettingError(f"the kernels built with {flags!r} added do not load: {e}") from None
    declare_quant(lib)
    return lib


def declare_attention(lib: ctypes.CDLL) -> None:
    """The argument types of csrc/paged_attention.cpp's entry points."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    for name in set(DECODE_ENTRY_POINTS.values()):
        getattr(lib, name).argtypes = [p, p, p, p, p, i, p, p, i, i, i, i, i, i, i, ctypes.c_float, ctypes.c_float]
        getattr(lib, name).restype = ctypes.c_int
    lib.kv_quantize_q8.argtypes = [p, i, i, p, i]
    lib.kv_quantize_q8.restype = None
    lib.kv_rotate.argtypes = [p, i, i, i]
    lib.kv_rotate.restype = None


def declare_sampling(lib: ctypes.CDLL) -> None:
    """The argument types of csrc/sampling.cpp's entry points."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.sample_draw.argtypes = [p, p, i, i, p, i]  # per-row arguments: kernels/sampling.py
    lib.sample_draw.restype = None
    lib.top_logprobs.argtypes = [p, i, i, p, i, p, p, p, i]
    lib.top_logprobs.restype = None


def declare_quant(lib: ctypes.CDLL) -> None:
    """The argument types of csrc/quant_gemm.cpp's entry points."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.quant_paths.argtypes = []
    lib.quant_paths.restype = ctypes.c_int
    lib.quant_default_path.argtypes = []
    lib.quant_default_path.restype = ctypes.c_int
    lib.quant_types.argtypes = [p, ctypes.c_int]
    lib.quant_types.restype = ctypes.c_int
    lib.quant_linear.argtypes = [p]  # an int64 array of its arguments: kernels/quant.py
    lib.quant_linear.restype = ctypes.c_int
    lib.quant_dequantize_rows.argtypes = [ctypes.c_int, p, i, i, ctypes.c_int, p, i, p]
    lib.quant_dequantize_rows.restype = ctypes.c_int
    lib.quant_repack.argtypes = [ctypes.c_int, p, i, i, p, ctypes.c_int]
    lib.quant_repack.restype = ctypes.c_int
    lib.quant_dot_peak.argtypes = [ctypes.c_int, i]
    lib.quant_dot_peak.restype = ctypes.c_int64


def decode_supported(cache: torch.Tensor) -> bool:
    return (cache.device.type == "cpu" and cache.dtype in (torch.float32, torch.bfloat16, torch.uint8)
            and library() is not None)


def kv_quantize_q8(x: torch.Tensor, rot: int = 0) -> torch.Tensor:
    """x [..., D] fp32 -> its q8_0 blocks [..., D / 32 * 34] (attention/kv_cache.py's format),
    each row rotated first by blocks of `rot` values (0: not)."""
    *lead, D = x.shape
    x = x.float().contiguous()
    out = torch.empty(*lead, D // 32 * 34, dtype=torch.uint8)
    library().kv_quantize_q8(x.data_ptr(), x.numel() // D, D, out.data_ptr(), rot)
    return out


def kv_rotate(x: torch.Tensor, rot: int) -> torch.Tensor:
    """x [..., D] fp32 with each block of `rot` values Walsh-Hadamard transformed (a new tensor)."""
    D = x.shape[-1]
    out = x.float().contiguous().clone()
    library().kv_rotate(out.data_ptr(), out.numel() // D, D, rot)
    return out


def paged_decode(q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, max_ctx: int,
                 window: int | None, scale: float, softcap: float | None = None) -> None:
    """out[rows[b]] = attention of q[rows[b]] over the first ctx[b] keys of sequence b's
    blocks (the last `window` of them with a sliding window); scores q.k * scale, soft-capped
    to softcap * tanh(s / softcap) when softcap is set.

    q, out: [T, H, D]; rows: [B] int64; k_cache, v_cache: one layer, [blocks, block_size,
    Hkv, D]; tables: [B, width] int64; ctx: [B] (or [B, 1]) int64; max_ctx >= ctx.max()."""
    for t in (q, out, rows, k_cache, v_cache, tables, ctx):
        assert t.is_contiguous() and t.device.type == "cpu"
    assert q.dtype == out.dtype and k_cache.dtype == v_cache.dtype and rows.dtype == tables.dtype == ctx.dtype == torch.int64
    _, H, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    B, width = tables.shape
    entry = DECODE_ENTRY_POINTS.get((q.dtype, k_cache.dtype))
    if entry is None:
        raise TypeError(f"paged decode: no kernel for {q.dtype} queries over a {k_cache.dtype} cache")
    failed = getattr(library(), entry)(
        q.data_ptr(), rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), width,
        ctx.data_ptr(), out.data_ptr(), B, H, Hkv, D, bs, window or 0, max_ctx, scale, softcap or 0.0)
    if failed:
        raise MemoryError(f"paged decode attention: no memory for {H} x {max_ctx} scores per thread")


PANEL = 32  # output columns per panel of a packed fp32 weight (NR in csrc/packed_gemm.cpp)


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's [N, K] weight reordered for `linear_packed_f32`: panels of 32 rows of w,
    each stored k-major (the 32 values of one k side by side), the last panel as wide as
    what is left. Same shape, dtype and element count as `weight`; only the order differs."""
    N, K = weight.shape
    full = N // PANEL * PANEL
    out = streamed_empty((N, K), weight.dtype)
    flat = out.view(-1)
    flat[:full * K].view(full // PANEL, K, PANEL).copy_(weight[:full].reshape(-1, PANEL, K).transpose(1, 2))
    flat[full * K:].view(K, N - full).copy_(weight[full:].t())
    return out


def unpack_f32(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight back from `pack_f32`'s order."""
    N, K = packed.shape
    full = N // PANEL * PANEL
    flat = packed.reshape(-1)
    body = flat[:full * K].reshape(-1, K, PANEL).transpose(1, 2).reshape(full, K)
    tail = flat[full * K:].reshape(K, N - full).t()
    return torch.cat([body, tail])


def linear_packed_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias) for a 2-D fp32 x on the CPU, w given as pack_f32(w)."""
    x = x.contiguous()
    if not x.device.type == packed.device.type == "cpu":
        raise RuntimeError("weights packed for the CPU GEMM cannot run on another device: load the model there")
    assert x.dtype == packed.dtype == torch.float32 and x.dim() == 2 and packed.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    M, K = x.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    library().linear_packed_f32(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                                y.data_ptr(), M, K, N)
    return y
