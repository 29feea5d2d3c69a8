"""Peak FLOP/s and memory bandwidth: the denominators of MFU and MBU.

GPUs: a table of vendor figures (dense, no sparsity), matched on the device name.
CPUs (and GPUs not in the table): a short measured probe, cached per machine, since a
CPU's useful peak depends on its cores, vector units and the threads torch uses, which
no table knows. A model on GGUF blocks computes in 8-bit integer dot products, not fp32
multiply-adds: its peak is the block kernels' 8-bit dot probe (kernels/quant.py: dot_peak),
so its MFU is measured against what that path can do. `--peak-flops` / `--peak-bandwidth`
override either figure.
"""
from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..kernels.cpu_kernels import first_processor
from ..user_cache import user_cache_dir

# (pattern on the device name, label, bf16/fp16 dense FLOP/s, fp32 FLOP/s, bandwidth B/s).
# The more specific names come first: "H100 PCIe" before "H100", "L40S" before "L4".
# fp32 is the non-tensor-core rate: torch does not use TF32 for fp32 matmuls by default.
GPU_PEAKS: list[tuple[str, str, float, float, float]] = [
    (r"H200", "H200", 989e12, 67e12, 4.8e12),
    (r"H100.*PCIe", "H100 PCIe", 756e12, 51e12, 2.0e12),
    (r"H100.*NVL", "H100 NVL", 835e12, 60e12, 3.9e12),
    (r"H100", "H100 SXM", 989e12, 67e12, 3.35e12),
    (r"A100", "A100", 312e12, 19.5e12, 2.0e12),
    (r"L40S", "L40S", 362e12, 91.6e12, 864e9),
    (r"L40\b", "L40", 181e12, 90.5e12, 864e9),
    (r"\bL4\b", "L4", 121e12, 30.3e12, 300e9),
    (r"4090", "RTX 4090", 165.2e12, 82.6e12, 1.01e12),
    (r"3090", "RTX 3090", 71e12, 35.6e12, 936e9),
    (r"B200", "B200", 2.25e15, 75e12, 8e12),
    (r"MI300X", "MI300X", 1.3074e15, 163.4e12, 5.3e12),
]


@dataclass
class Peaks:
    flops: float  # FLOP/s in the engine's dtype
    bandwidth: float  # bytes/s
    source: str  # "table" | "measured" | "cached" | "override", or "a / b" when the two differ
    device_name: str
    compute: str = "matmul"  # what flops measures: "matmul" (the dtype's) or "8-bit dot" (block formats)


def cpu_model() -> str:
    return first_processor().get("model name") or platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def table_peaks(name: str, dtype: torch.dtype) -> tuple[float, float, str] | None:
    """(flops, bandwidth, label) for a known GPU name, or None."""
    for pattern, label, half, fp32, bw in GPU_PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return (fp32 if dtype == torch.float32 else half), bw, label
    return None


# --- the probe -------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, budget_s: float, min_reps: int = 3) -> float:
    """Best wall time of fn() over at least min_reps runs or until budget_s is spent:
    the best run is the one least disturbed by other work on the machine."""
    fn()  # warm up (allocator, kernel selection, page faults)
    _sync(device)
    best, start, reps = float("inf"), time.perf_counter(), 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        reps += 1
        if time.perf_counter() - start > 4 * budget_s:
            break
    return best


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache the first CPU reports in sysfs (Linux), in bytes; 0 where none is read."""
    sizes = []
    for f in root.glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip()) if f.is_file() else None
        if m:
            sizes.append(int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)])
    return max(sizes, default=0)


def cpu_probe_bytes(llc: int) -> int:
    """The CPU bandwidth probe's tensor: 256 MiB, or four times a larger last-level cache (up to
    4 GiB). A 256 MiB sum on a Xeon with 300 MiB of L3 read 56.6 GB/s against 31.6 from 1 GiB:
    the cache's speed, not the memory's."""
    return min(max(256 << 20, 4 * llc), 4 << 30)


def probe_bytes(device: torch.device) -> int:
    """The bandwidth probe's tensor on this device."""
    return 1 << 30 if device.type == "cuda" else cpu_probe_bytes(last_level_cache_bytes())


def measure_bandwidth(device: torch.device, nbytes: int | None = None, budget_s: float = 0.5) -> float:
    """Read bandwidth: summing a tensor far larger than the caches streams it from memory
    once, as a decode step streams the weights (a copy would also count writes)."""
    nbytes = nbytes or probe_bytes(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    t = _best_time(lambda: x.sum(), device, budget_s)
    return nbytes / t


def measure_flops(device: torch.device, dtype: torch.dtype, n: int | None = None, budget_s: float = 0.8) -> float:
    """Square matmul in the engine's dtype with the threads torch uses."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _best_time(lambda: a @ b, device, budget_s)
    return 2 * n ** 3 / t


def cache_path() -> Path:
    return user_cache_dir() / "peaks.json"


def cache_key(device: torch.device, dtype: torch.dtype, block: bool = False) -> str:
    """block: the 8-bit dot peak of the kernels' current path (each path has its own)."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    if block:
        from ..kernels import quant

        kind = f"int8-dot-{quant.path_name()}"
    else:
        kind = str(dtype).removeprefix('torch.')
    return f"{device.type}|{device_name(device)}|threads={threads}|{kind}"


def measure_dot_peak() -> float:
    """The block kernels' 8-bit dot peak on the threads torch uses (0.0: no probe on this path)."""
    from ..kernels import quant

    return quant.dot_peak()


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def measured_peaks(device: torch.device, dtype: torch.dtype, remeasure: bool = False,
                   block: bool = False) -> tuple[float, float, str]:
    """(flops, bandwidth, "cached" | "measured"), probing at most once per machine/threads/dtype
    (block: the 8-bit dot peak in place of the dtype's matmul) and bandwidth probe size (an entry
    from another size, or from before sizes were kept, is measured again)."""
    path, key, nbytes = cache_path(), cache_key(device, dtype, block), probe_bytes(device)
    cache = _read_cache(path)
    hit = cache.get(key)
    if (hit and not remeasure and hit.get("flops", 0) > 0 and hit.get("bandwidth", 0) > 0
            and hit.get("probe_bytes") == nbytes):
        return hit["flops"], hit["bandwidth"], "cached"
    bandwidth = measure_bandwidth(device, nbytes)
    flops = measure_dot_peak() if block else measure_flops(device, dtype)
    cache[key] = {"flops": flops, "bandwidth": bandwidth, "probe_bytes": nbytes,
                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only home only costs a re-probe next time
    return flops, bandwidth, "measured"


def resolve_peaks(device: torch.device, dtype: torch.dtype, peak_flops: float | None = None,
                  peak_bandwidth: float | None = None, remeasure: bool = False, block: bool = False) -> Peaks:
    """block: the model runs on GGUF blocks on the CPU (its compute peak is the 8-bit dot's,
    where this CPU has a probe for its path)."""
    name = device_name(device)
    dot = measured_peaks(device, dtype, remeasure, block=True) if block and device.type == "cpu" else None
    block = dot is not None and dot[0] > 0  # no probe on this path: the matmul's peak stands in
    compute = "8-bit dot" if block else "matmul"
    if peak_flops is not None and peak_bandwidth is not None:
        return Peaks(peak_flops, peak_bandwidth, "override", name, compute)
    found = table_peaks(name, dtype) if device.type == "cuda" else None
    if found:
        flops, bandwidth, label = found
        source, name = "table", f"{name} ({label})"
    else:
        flops, bandwidth, source = dot if block else measured_peaks(device, dtype, remeasure)
    sources = ["override" if peak_flops is not None else source,
               "override" if peak_bandwidth is not None else source]
    return Peaks(peak_flops if peak_flops is not None else flops,
                 peak_bandwidth if peak_bandwidth is not None else bandwidth,
                 sources[0] if sources[0] == sources[1] else " / ".join(sources), name, compute)


def peaks_dict(p: Peaks) -> dict:
    return asdict(p)
