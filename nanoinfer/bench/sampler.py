"""`bench sampler`: a step's sampling at R rows, the batched sampler against the per-row
definition it replaced (RowSampler.sample), in one run, alternating, on logits with the
default model's vocabulary size. The rows' tokens and logprobs are checked equal. The batched
sampler runs with the compiled sampling (kernels/sampling.py) unless --no-kernels."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..kernels.sampling import compiled_for
from ..sampling import RowSampler, SampleRow, SamplingParams, sample_rows

MIXES = {
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "temperature": {"temperature": 1.0},
    "top_k": {"temperature": 0.7, "top_k": 40},
    "penalties": {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5, "logprobs": 2},
    "greedy+bias": {"temperature": 0.0, "logit_bias": {13: 5.0}},
}


def run(a: argparse.Namespace) -> int:
    g = torch.Generator().manual_seed(a.seed)
    # logits shaped like a small model's: a few likely tokens over a long tail
    logits = torch.randn(a.rows, a.vocab, generator=g) * a.spread
    print(f"bench sampler: {a.rows} rows x {a.vocab} tokens, logits N(0, {a.spread}^2), "
          f"{torch.get_num_threads()} threads, median of {a.repeats}")
    compiled = None if a.no_kernels else compiled_for(logits.device)
    print(f"{'mix':<12} {'per-row ms':>11} {'batched ms':>11} {'speed-up':>9}"
          + ("" if compiled else "   (PyTorch path only)"))
    for name in a.mixes.split(","):
        params = [SamplingParams(seed=i, **MIXES[name]) for i in range(a.rows)]
        per_row, batched = [], []
        for _ in range(a.repeats):
            rows = [RowSampler(p, a.vocab, [1, 2, 3]) for p in params]
            t0 = time.perf_counter()
            expected = [r.sample(logits[i]) for i, r in enumerate(rows)]
            per_row.append(time.perf_counter() - t0)
            rows = [RowSampler(p, a.vocab, [1, 2, 3]) for p in params]
            t0 = time.perf_counter()
            out = sample_rows(logits, [SampleRow(r, i) for i, r in enumerate(rows)], compiled)
            batched.append(time.perf_counter() - t0)
            if [(s.token, s.logprobs) for s in out] != expected:
                raise SystemExit(f"{name}: the batched sampler's tokens or logprobs differ from the per-row definition's")
        old, new = statistics.median(per_row), statistics.median(batched)
        print(f"{name:<12} {old * 1e3:>11.1f} {new * 1e3:>11.1f} {old / new:>8.2f}x")
    return 0
