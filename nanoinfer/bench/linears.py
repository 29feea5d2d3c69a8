"""`bench linears`: the block GEMM alone, on a model file's own weights. Each block type's
weights are repacked as the model repacks them, and for each row count every weight of the
type runs once in turn, as a decode step meets them (from memory, unless they all fit in the
caches); the median of the runs, and each row count's time against the first's. So a kernel
change shows apart from the rest of a step, per type (or, with `--by shape`, per type and
weight shape: where a tile's cost depends on K, or one large weight such as the head stands
apart), and `--path` runs one dispatch path (as NANOINFER_QUANT_PATH does) for comparing paths
on one CPU. With `--weights cached` each weight's call is timed after WARM_CALLS untimed ones on
the same weight, so a weight that fits the caches runs from them: the kernels' compute rate,
against which the streamed figure shows what memory costs (a row count whose streamed time is
well above its cached one is not bound by its multiply-adds alone). Each weight is one call
from Python (some microseconds), which the compiled decoder stack does not pay: a file of many
small weights reads slower here than its step runs them.

`--against FLAGS` builds the block GEMM a second time with compiler flags added (a kernel
change behind a macro, or a tuning macro of cpu_kernels' set another way) and times both
builds in one process, on the same weights and activations, in turn (the order swapped each
run): a host whose memory and neighbours change from minute to minute moves both alike, where
alternating processes compare two moments. The two builds' outputs must agree bit for bit
(every dispatch path, tile and tuning keeps a row's bits), checked on every weight first."""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

from .. import threads
from ..errors import NanoinferError
from ..kernels import cpu_kernels, quant
from ..loaders import load_files
from ..tensors import QuantizedTensor
from .common import emit_json, machine, median, parse_counts, print_table, progress, progress_done, versions

WeightSet = tuple[str, tuple[int, int] | None]  # (type name, the weights' shape with --by shape, else None)


def _weight_sets(path: str | None, by_shape: bool) -> dict[WeightSet, list[QuantizedTensor]]:
    """The file's linear weights that have a block kernel, repacked, by type name and, with
    by_shape, shape (a tied embedding counts: it is the head)."""
    files = load_files(path, dtype=None)
    tied = "lm_head.weight" not in files.state
    sets: dict[WeightSet, list[QuantizedTensor]] = {}
    for name, t in files.state.items():
        if not isinstance(t, QuantizedTensor) or not quant.supported(t.qtype):
            continue
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        sets.setdefault((t.type_name, tuple(t.shape) if by_shape else None), []).append(quant.repack(t))
    if files.release is not None:
        files.release()
    return sets


# Untimed calls before a cached one. One was not enough: on a 2-vCPU Xeon (Emerald Rapids) a Q4_K
# weight of 7.7 MB then ran at 30 GB/s at 1 row, after three at 40 (in L2 alone: 52-55).
WARM_CALLS = 3


def _time_set(ws: list[QuantizedTensor], xs: dict[int, torch.Tensor], cached: bool,
              library: ctypes.CDLL | None = None) -> float:
    """Seconds the set's calls take, each weight once in turn; cached: each timed call after
    WARM_CALLS untimed ones on the same weight. `library`: the --against build, else the library."""
    total = 0.0
    for w in ws:
        x = xs[w.shape[1]]
        for _ in range(WARM_CALLS if cached else 0):
            quant.linear(x, w.data, w.qtype, repacked=w.repacked, library=library)
        t0 = time.perf_counter()
        quant.linear(x, w.data, w.qtype, repacked=w.repacked, library=library)
        total += time.perf_counter() - t0
    return total


def _check_same_bits(label: str, ws: list[QuantizedTensor], xs: dict[int, torch.Tensor], against: ctypes.CDLL,
                     rows: int) -> None:
    for w in ws:
        x = xs[w.shape[1]]
        if not torch.equal(quant.linear(x, w.data, w.qtype, repacked=w.repacked),
                           quant.linear(x, w.data, w.qtype, repacked=w.repacked, library=against)):
            raise NanoinferError(f"--against: the two builds' outputs differ ({label} {tuple(w.shape)}, {rows} rows): "
                                 "a kernel change must keep every row's bits")


def run(a: argparse.Namespace) -> int:
    n_threads = threads.use(a.threads)
    rows = parse_counts(a.rows, "--rows", "1,4,8")
    if a.runs < 1:
        raise NanoinferError("--runs must be >= 1")
    quant.set_path(None if a.path == "auto" else a.path)
    against = None
    if a.against is not None:
        progress(f"building the block GEMM with {a.against!r} added ...")
        against = cpu_kernels.quant_library_with(a.against)
        progress_done()
        if quant.current_path() and quant.path_name() not in quant.paths(against):
            raise NanoinferError(f"--against: the build with {a.against!r} added has no {quant.path_name()} path")
    builds = [None] if against is None else [None, against]  # None: the library
    progress("loading and repacking the weights ...")
    sets = _weight_sets(a.model, a.by == "shape")
    progress_done()
    if not sets:
        raise NanoinferError(f"{a.model or 'the default model'}: no weight runs in a block kernel "
                             "(not a GGUF of block types, or no compiled kernels)")
    g = torch.Generator().manual_seed(a.seed)
    path = quant.path_name() or "none"  # auto: NANOINFER_QUANT_PATH's, else the default
    print(f"bench linears: {a.model or 'the default model'}, path {path}, {n_threads} threads, weights {a.weights}, "
          f"median of {a.runs}" + (f", against the build with {a.against!r} added" if against is not None else ""))
    results, table = [], []
    for (type_name, shape), ws in sorted(sets.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())):
        label = type_name + (f" {shape[0]}x{shape[1]}" if shape else "")
        nbytes = sum(w.data.numel() for w in ws)
        xs = {m: {K: torch.randn(m, K, generator=g) for K in {w.shape[1] for w in ws}} for m in rows}
        if against is not None:
            for m in rows:
                _check_same_bits(label, ws, xs[m], against, m)
        times: list[dict[int, list[float]]] = [{m: [] for m in rows} for _ in builds]
        order = list(enumerate(builds))
        for run in range(a.runs):
            for m in rows:  # alternating: the row counts (and the builds, first one then the other) see the same machine
                for b, lib in order if run % 2 == 0 else order[::-1]:
                    times[b][m].append(_time_set(ws, xs[m], cached=a.weights == "cached", library=lib))
        base = median(times[0][rows[0]])
        for m in rows:
            t = median(times[0][m])
            result = {"type": type_name, "shape": list(shape) if shape else None, "weights": len(ws),
                      "bytes": nbytes, "rows": m, "seconds": t, "seconds_all": times[0][m],
                      "bytes_per_s": nbytes / t, "vs_first": t / base}
            line = [label, str(len(ws)), f"{nbytes / 2**20:.1f}", str(m), f"{t * 1e3:.2f}",
                    f"{nbytes / t / 1e9:.1f}", f"{t / base:.2f}x"]
            if against is not None:
                ta = median(times[1][m])
                result.update(against_seconds=ta, against_seconds_all=times[1][m], against_vs_this=ta / t)
                line += [f"{ta * 1e3:.2f}", f"{ta / t:.2f}x"]
            results.append(result)
            table.append(line)
    print_table(["type", "weights", "MiB", "rows", "ms", "GB/s", f"vs {rows[0]} row(s)"]
                + (["against ms", "against / this"] if against is not None else []), table)
    emit_json({"bench": "linears", "model": str(a.model) if a.model else None, "path": path, "by": a.by,
               "weights_from": a.weights, "against": a.against,
               "threads": n_threads, "runs": a.runs, "versions": versions(),
               "machine": machine(torch.device("cpu")), "results": results})
    return 0
