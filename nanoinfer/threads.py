"""How many CPU threads a model runs on: `--threads N` on every command that runs one, else
the physical cores this process may use (hyperthreads share a core's vector units, which the
kernels already fill). A process split into parts (replicas, tensor-parallel ranks) gives each
part an equal share, at least one thread; the part says its share when it starts.

torch's intra-op threads and the compiled kernels' OpenMP team are one setting: the kernels
share torch's OpenMP runtime, and `use` sets it for the calling thread and for threads started
after (the engine's)."""
from __future__ import annotations

import os
from pathlib import Path

import torch


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on; the CPU count
    where the topology is not readable."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def share(total: int | None, parts: int) -> int:
    """One part's threads when `total` (default: the physical cores) is split `parts` ways."""
    return max(1, (total or physical_cores()) // max(1, parts))


def use(threads: int | None) -> int:
    """Run torch and the kernels on `threads` (default: the physical cores); returns the count.
    OMP_NUM_THREADS is set too, so that threads started later (the engine's, a worker
    process's) begin with the same count."""
    n = threads or physical_cores()
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    return n
