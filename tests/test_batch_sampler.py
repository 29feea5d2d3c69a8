"""The batched sampler equals the per-row definition (RowSampler.sample) bit for bit on the CPU:
the same tokens, logprobs and generator states, for every mix of parameters, alone and in any
batch, with verification rows sampled ahead and forks sharing their parent's logits. Each test
runs on the PyTorch path alone and with the compiled sampling (kernels/sampling.py), built for
this CPU and built portable (no AVX2)."""
from __future__ import annotations

import copy
import ctypes
import random

import pytest
import torch

from nanoinfer.kernels import cpu_kernels
from nanoinfer.kernels import sampling as sampling_kernels
from nanoinfer.sampling import RowSampler, SampleRow, SamplingParams, batch_sampler, sample_rows


@pytest.fixture(scope="module")
def portable_library():
    compiler = cpu_kernels.find_compiler()
    if compiler is None or not cpu_kernels.enabled():
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NANOINFER_CXXFLAGS", "-DSAMPLING_PORTABLE")
        path, err = cpu_kernels.build(compiler, cpu_kernels.CSRC, [cpu_kernels.CSRC / "sampling.cpp"])
    assert err is None, err
    lib = ctypes.CDLL(str(path))
    cpu_kernels.declare_sampling(lib)
    return lib


@pytest.fixture(params=["torch", "compiled", "portable"])
def compiled(request, monkeypatch):
    """The compiled sampling to pass to sample_rows, or None (the PyTorch path alone)."""
    if request.param == "torch":
        return None
    if request.param == "portable":
        lib = request.getfixturevalue("portable_library")
        monkeypatch.setattr(cpu_kernels, "library", lambda: lib)
    found = sampling_kernels.compiled_for(torch.device("cpu"))
    if found is None:
        pytest.skip("no compiled kernels here")
    return found

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


def batched(logits: torch.Tensor, rows: list[tuple[RowSampler, int, list[int]]], compiled=None) -> list[tuple]:
    samplers = {id(s): copy.deepcopy(s) for s, _, _ in rows}
    argmax = logits.numpy().argmax(-1).tolist()
    jobs = [SampleRow(samplers[id(s)], row, list(ahead), argmax[row]) for s, row, ahead in rows]
    out = sample_rows(logits, jobs, compiled)
    results = []
    for job, o in zip(jobs, out):
        assert o.error is None
        state = o.generator_state if o.generator_state is not None else job.sampler.generator.get_state()
        results.append((o.token, o.logprobs, state))
    return results


def test_every_mix_equals_the_per_row_definition_alone_and_batched(compiled):
    logits = logits_rows(4 * len(MIXES), 0)
    samplers = [make_sampler(mix, 3 * i + j) for j in range(3) for i, mix in enumerate(MIXES)]
    for s in samplers:  # some history for the penalties and min_tokens
        for token in (4, 4, 17):
            s.commit(token)
    rows = [(s, (4 * i + i // len(MIXES)) % len(logits), []) for i, s in enumerate(samplers)]
    expected = per_row(logits, rows)
    got = batched(logits, rows, compiled)
    alone = [batched(logits, [r], compiled)[0] for r in rows]
    for e, g, a in zip(expected, got, alone):
        assert e[0] == g[0] == a[0]
        assert e[1] == g[1] == a[1]
    # row order and batch composition do not matter
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    shuffled = batched(logits, [rows[i] for i in order], compiled)
    assert [shuffled[order.index(i)][:2] for i in range(len(rows))] == [g[:2] for g in got]


def test_verification_rows_and_forks(compiled):
    """A sequence's k+1 rows are sampled as if each guess before a row were taken; committing the
    rows that were taken leaves its generator where one-step-at-a-time sampling leaves it."""
    logits = logits_rows(12, 1)
    for mix in MIXES:
        parent, fork = make_sampler(mix, 3), make_sampler(mix, 4)
        guesses = [int(logits[0].argmax()), 17, int(logits[2].argmax())]
        rows = [(fork, 0, [])] + [(parent, j, guesses[:j]) for j in range(4)]
        expected = per_row(logits, rows)
        got = batched(logits, rows, compiled)
        assert [(e[0], e[1]) for e in expected] == [(g[0], g[1]) for g in got], mix
        for e, g in zip(expected, got):
            assert torch.equal(e[2], g[2]), mix


def test_a_row_that_excludes_every_token_fails_alone(compiled):
    logits = logits_rows(3, 2)
    banned = make_sampler({"temperature": 1.0, "min_tokens": 5}, 0)
    banned.banned_until_min_tokens = list(range(VOCAB))
    fine = make_sampler({"temperature": 1.0}, 1)
    out = sample_rows(logits, [SampleRow(banned, 0), SampleRow(fine, 1)], compiled)
    assert isinstance(out[0].error, ValueError) and out[1].error is None
    assert out[1].token == per_row(logits, [(make_sampler({"temperature": 1.0}, 1), 1, [])])[0][0]


@pytest.mark.parametrize("mix", [{"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 50}])
def test_many_rows_of_a_real_vocabulary(mix, compiled):
    """49,152 tokens (the default model's vocabulary), 64 rows in chunks of several: the chunking
    changes nothing."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49152, generator=g) * 4
    rows = [(make_big(mix, i), i, []) for i in range(64)]
    old = batch_sampler.CHUNK_ROWS
    try:
        batch_sampler.CHUNK_ROWS = 5
        got = [r[:2] for r in batched(logits, rows, compiled)]
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


def test_the_logits_are_never_changed(compiled):
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
                sample_rows(logits, [SampleRow(make_sampler(MIXES[i], i), i) for i in rows], compiled)
            assert torch.equal(torch.nan_to_num(logits), torch.nan_to_num(before))


def test_the_compiled_draw_decides_nearly_every_row_and_each_as_the_reference(compiled):
    """The compiled draw answers where it can certify the reference's token: on a real
    vocabulary that is nearly every row (it sends back a row only where a comparison falls
    inside its error bound, or the drawn token ties under top_p), and every answer is the
    reference's token, for float32 and float64 logits."""
    if compiled is None:
        pytest.skip("the compiled draw's own test")
    mixes = [{"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 40},
             {"temperature": 1.2, "min_p": 0.02, "top_p": 0.9}, {"temperature": 0.9, "repetition_penalty": 1.3,
                                                                  "presence_penalty": 0.4, "logit_bias": {7: 9.0}}]
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        logits = (torch.randn(60, 49152, generator=g) * torch.rand(60, 1, generator=g) * 8).to(dtype)
        usable = mixes if dtype == torch.float32 else mixes[:4]  # a logit bias is float32, as the engine's logits
        samplers = [make_big(usable[i % len(usable)], i) for i in range(60)]
        jobs = [SampleRow(copy.deepcopy(s), i) for i, s in enumerate(samplers)]
        uniforms = batch_sampler.draw_uniforms(jobs, list(range(60)), [batch_sampler.Sampled() for _ in jobs])
        drawn = compiled.draw(logits, jobs, [float(uniforms[i]) for i in range(60)])
        expected = [r[0] for r in per_row(logits, [(s, i, []) for i, s in enumerate(samplers)])]
        assert sum(t is None for t in drawn) <= 1
        assert all(t is None or t == e for t, e in zip(drawn, expected))


def test_rows_the_compiled_draw_cannot_certify_go_to_the_reference(compiled):
    """NaN and +inf logits, every token banned, ties at the drawn token under top_p: sent back,
    and sample_rows then gives what the PyTorch path gives (a row's own error included)."""
    if compiled is None:
        pytest.skip("the compiled draw's own test")
    logits = logits_rows(5, 7)
    logits[0, 10] = float("nan")
    logits[1, 12] = float("inf")
    logits[2] = float("-inf")
    logits[3] = 0.0  # every token ties
    logits[4, :] = -5.0
    logits[4, :3] = 2.0  # three tied favourites
    mixes = [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.5},
             {"temperature": 1.0, "top_p": 0.9, "logprobs": 2}]
    jobs = [SampleRow(make_sampler(m, i), i) for i, m in enumerate(mixes)]
    uniforms = batch_sampler.draw_uniforms(jobs, list(range(5)), [batch_sampler.Sampled() for _ in jobs])
    assert compiled.draw(logits, jobs, [float(uniforms[i]) for i in range(5)]) == [None] * 5
    with_kernels = sample_rows(logits, [SampleRow(make_sampler(m, i), i) for i, m in enumerate(mixes)], compiled)
    without = sample_rows(logits, [SampleRow(make_sampler(m, i), i) for i, m in enumerate(mixes)])
    for a, b in zip(with_kernels, without):
        assert (a.token, a.logprobs, type(a.error)) == (b.token, b.logprobs, type(b.error))
    lp = torch.log_softmax(logits[4:5], -1)
    ranks, tops = compiled.top_logprobs(lp, lp[:, 0], 2)
    assert ranks == [1] and tops == [None]  # the tied favourites' order is torch.topk's


def test_logits_the_kernel_does_not_take_go_to_the_reference(compiled):
    """bfloat16 logits (not the engine's, but a caller's): the compiled sampling answers nothing
    and the PyTorch path gives its tokens and logprobs."""
    if compiled is None:
        pytest.skip("the compiled draw's own test")
    logits = logits_rows(4, 9).to(torch.bfloat16)
    mixes = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "logprobs": 2}, {"temperature": 0.8, "top_k": 5},
             {"temperature": 0.0, "logprobs": 1}]
    got = sample_rows(logits, [SampleRow(make_sampler(m, i), i) for i, m in enumerate(mixes)], compiled)
    want = sample_rows(logits, [SampleRow(make_sampler(m, i), i) for i, m in enumerate(mixes)])
    assert [(a.token, a.logprobs) for a in got] == [(b.token, b.logprobs) for b in want]
