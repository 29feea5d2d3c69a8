"""The batched sampler equals the per-row definition (RowSampler.sample) bit for bit on the CPU:
the same tokens, logprobs and generator states, for every mix of parameters, alone and in any
batch, with verification rows sampled ahead and forks sharing their parent's logits."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from nanoinfer.sampling import RowSampler, SampleRow, SamplingParams, batch_sampler, sample_rows

VOCAB = 3000

MIXES = [
    {"temperature": 0.0},
    {"temperature": 0.0, "logit_bias": {5: 100.0, 7: -100.0}},
    {"temperature": 0.0, "repetition_penalty": 1.3, "min_tokens": 3},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.999},  # flat enough that the candidates grow past 64 and 512
    {"temperature": 0.8, "top_k": 40},
    {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.1, "min_p": 0.2},
    {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logprobs": 3},
    {"temperature": 0.6, "repetition_penalty": 1.2, "logit_bias": {1: 5.0, 2: -3.0}, "logprobs": 0},
    {"temperature": 1.0, "repetition_penalty": 1e-38},  # seen tokens go to +inf and share the mass
    {"temperature": 0.5, "min_tokens": 4, "top_p": 0.95, "logprobs": 1},
    {"temperature": 0.0, "logprobs": 2},
]


def make_sampler(mix: dict, seed: int) -> RowSampler:
    params = SamplingParams(seed=seed, max_tokens=50, **mix)
    return RowSampler(params, VOCAB, prompt_ids=[3, 4, 5, 9, 4], banned_until_min_tokens=[0, 11])


def logits_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sharp = torch.rand(n, 1, generator=g) * 6
    x = torch.randn(n, VOCAB, generator=g) * sharp
    x[:, :40] = x[:, 40:80].clone()  # exact ties
    x[torch.rand(n, VOCAB, generator=g) < 0.05] = float("-inf")  # a grammar's mask
    return x


def per_row(logits: torch.Tensor, rows: list[tuple[RowSampler, int, list[int]]]) -> list[tuple]:
    """The reference: each row sampled alone, a verification row after committing its guesses."""
    results = []
    for sampler, row, ahead in rows:
        s = copy.deepcopy(sampler)
        for token in ahead:
            s.commit(token)
        for _ in ahead:  # the draws the rows before it made
            if not s.params.greedy:
                torch.rand((), generator=s.generator, dtype=torch.float64)
        token, lp = s.sample(logits[row])
        results.append((token, lp, s.generator.get_state()))
    return results


def batched(logits: torch.Tensor, rows: list[tuple[RowSampler, int, list[int]]]) -> list[tuple]:
    samplers = {id(s): copy.deepcopy(s) for s, _, _ in rows}
    argmax = logits.numpy().argmax(-1).tolist()
    jobs = [SampleRow(samplers[id(s)], row, list(ahead), argmax[row]) for s, row, ahead in rows]
    out = sample_rows(logits, jobs)
    results = []
    for job, o in zip(jobs, out):
        assert o.error is None
        state = o.generator_state if o.generator_state is not None else job.sampler.generator.get_state()
        results.append((o.token, o.logprobs, state))
    return results


def test_every_mix_equals_the_per_row_definition_alone_and_batched():
    logits = logits_rows(4 * len(MIXES), 0)
    samplers = [make_sampler(mix, 3 * i + j) for j in range(3) for i, mix in enumerate(MIXES)]
    for s in samplers:  # some history for the penalties and min_tokens
        for token in (4, 4, 17):
            s.commit(token)
    rows = [(s, (4 * i + i // len(MIXES)) % len(logits), []) for i, s in enumerate(samplers)]
    expected = per_row(logits, rows)
    got = batched(logits, rows)
    alone = [batched(logits, [r])[0] for r in rows]
    for e, g, a in zip(expected, got, alone):
        assert e[0] == g[0] == a[0]
        assert e[1] == g[1] == a[1]
    # row order and batch composition do not matter
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    shuffled = batched(logits, [rows[i] for i in order])
    assert [shuffled[order.index(i)][:2] for i in range(len(rows))] == [g[:2] for g in got]


def test_verification_rows_and_forks():
    """A sequence's k+1 rows are sampled as if each guess before a row were taken; committing the
    rows that were taken leaves its generator where one-step-at-a-time sampling leaves it."""
    logits = logits_rows(12, 1)
    for mix in MIXES:
        parent, fork = make_sampler(mix, 3), make_sampler(mix, 4)
        guesses = [int(logits[0].argmax()), 17, int(logits[2].argmax())]
        rows = [(fork, 0, [])] + [(parent, j, guesses[:j]) for j in range(4)]
        expected = per_row(logits, rows)
        got = batched(logits, rows)
        assert [(e[0], e[1]) for e in expected] == [(g[0], g[1]) for g in got], mix
        for e, g in zip(expected, got):
            assert torch.equal(e[2], g[2]), mix


def test_a_row_that_excludes_every_token_fails_alone():
    logits = logits_rows(3, 2)
    banned = make_sampler({"temperature": 1.0, "min_tokens": 5}, 0)
    banned.banned_until_min_tokens = list(range(VOCAB))
    fine = make_sampler({"temperature": 1.0}, 1)
    out = sample_rows(logits, [SampleRow(banned, 0), SampleRow(fine, 1)])
    assert isinstance(out[0].error, ValueError) and out[1].error is None
    assert out[1].token == per_row(logits, [(make_sampler({"temperature": 1.0}, 1), 1, [])])[0][0]


@pytest.mark.parametrize("mix", [{"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 50}])
def test_many_rows_of_a_real_vocabulary(mix):
    """49,152 tokens (the default model's vocabulary), 64 rows in chunks of several: the chunking
    changes nothing."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49152, generator=g) * 4
    rows = [(make_big(mix, i), i, []) for i in range(64)]
    old = batch_sampler.CHUNK_ROWS
    try:
        batch_sampler.CHUNK_ROWS = 5
        got = [r[:2] for r in batched(logits, rows)]
    finally:
        batch_sampler.CHUNK_ROWS = old
    expected = [r[:2] for r in per_row(logits, rows)]
    assert got == expected


def make_big(mix: dict, seed: int) -> RowSampler:
    return RowSampler(SamplingParams(seed=seed, **mix), 49152, [1, 2, 3])


def test_bench_sampler_checks_its_tokens_and_reports(capsys):
    """`nanoinfer bench sampler` (the figures in docs/benchmarks.md) runs both paths and stops if
    their tokens differ."""
    from nanoinfer.bench.cli import main

    assert main(["sampler", "--rows", "6", "--vocab", "3000", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert all(mix in out for mix in ("top_p", "temperature", "top_k", "penalties", "greedy+bias"))


def test_the_logits_are_never_changed():
    """Bias, bans, penalties and the scaling work on copies: the logits rows (which logprobs and
    the other rows read) stay as they were, in float32 and in float64."""
    for dtype in (torch.float32, torch.float64):
        for inference in (False, True):  # the engine's logits are inference tensors
            logits = logits_rows(len(MIXES), 3).to(dtype)
            if inference:
                with torch.inference_mode():
                    logits = logits.clone()
            before = logits.clone()
            for rows in ([0], [1], [2], [9], [10], [12], list(range(len(MIXES)))):  # alone, and all
                sample_rows(logits, [SampleRow(make_sampler(MIXES[i], i), i) for i in rows])
            assert torch.equal(torch.nan_to_num(logits), torch.nan_to_num(before))
