"""The row sampler's filters and draw against their definitions."""
from __future__ import annotations

import pytest
import torch

from nanoinfer.sampling import RowSampler, SamplingParams
from nanoinfer.sampling.sampler import nucleus


def nucleus_by_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    """top_p's definition: sort the whole vocabulary, keep a token while the mass before it is below top_p."""
    vals, ids = torch.sort(probs, descending=True)
    keep = (vals.cumsum(0) - vals) < top_p
    keep[0] = True
    return set(ids[keep].tolist())


@pytest.mark.parametrize("sharpness", [0.05, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_nucleus_matches_the_full_sort(sharpness, top_p):
    """Peaked and flat distributions (flat ones keep thousands of tokens: the candidate set has to grow
    past 64 and 256), some tokens masked to -inf."""
    g = torch.Generator().manual_seed(int(sharpness * 100 + top_p * 1000))
    for _ in range(5):
        logits = torch.randn(5000, generator=g, dtype=torch.float64) * sharpness
        logits[torch.randint(0, 5000, (300,), generator=g)] = float("-inf")
        probs = torch.softmax(logits, -1)
        ids, vals = nucleus(probs, top_p)
        assert set(ids.tolist()) == nucleus_by_sort(probs, top_p)
        assert torch.equal(vals, probs[ids]) and bool((vals[:-1] >= vals[1:]).all())
    flat = torch.full((5000,), 1 / 5000, dtype=torch.float64)  # ties throughout
    assert len(nucleus(flat, 0.95)[0]) == len(nucleus_by_sort(flat, 0.95)) in (4750, 4751)


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    row = RowSampler(params, logits.shape[0], [])
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[row.sample(logits)[0]] += 1
    return counts / n


@pytest.mark.parametrize("params", [dict(temperature=0.7, top_p=0.8), dict(temperature=1.0, top_k=5),
                                    dict(temperature=1.3, min_p=0.1, top_p=0.9), dict(temperature=1.0)])
def test_draws_follow_the_filtered_distribution(params):
    """8000 seeded draws land within 0.03 (total variation) of the filtered distribution, where the
    unfiltered one is at least 0.05 away (except with no filter, where the two are the same)."""
    logits = torch.tensor([3.0, 2.5, 2.2, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    p = SamplingParams(seed=7, **params)
    exact = torch.softmax(logits.double() / p.temperature, -1)
    if p.min_p > 0:
        exact = torch.where(exact < p.min_p * exact.max(), 0.0, exact)
    if p.top_k > 0:
        exact = torch.where(exact < torch.topk(exact, p.top_k).values[-1], 0.0, exact)
    if p.top_p < 1.0:
        kept = torch.zeros_like(exact, dtype=torch.bool)
        kept[list(nucleus_by_sort(exact / exact.sum(), p.top_p))] = True
        exact = torch.where(kept, exact, 0.0)
    exact = exact / exact.sum()
    seen = draws(p, logits, 8000).double()
    assert 0.5 * float((seen - exact).abs().sum()) < 0.03
    unfiltered = torch.softmax(logits.double() / p.temperature, -1)
    if params.keys() != {"temperature"}:
        assert 0.5 * float((unfiltered - exact).abs().sum()) > 0.05
    assert bool((seen[exact == 0] == 0).all())  # a filtered token is never drawn


def test_a_seed_repeats_its_draws():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
    a, b = RowSampler(p, 1000, []), RowSampler(p, 1000, [])
    assert [a.sample(logits)[0] for _ in range(50)] == [b.sample(logits)[0] for _ in range(50)]
    c = RowSampler(SamplingParams(temperature=1.0, top_p=0.95, seed=4), 1000, [])
    assert [c.sample(logits)[0] for _ in range(50)] != [RowSampler(p, 1000, []).sample(logits)[0] for _ in range(50)]
