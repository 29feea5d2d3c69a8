"""The CPU's draw for sampled rows (csrc/sampling.cpp): the logit bias, penalties and
min_tokens bans, then temperature, min_p, top_k, top_p and the inverse-CDF draw, in a few
passes over each row's logits, the step's rows shared among the threads.

Each token it returns is certified to be the one the reference definition
(sampling/sampler.py: RowSampler.process and RowSampler.draw, float64 PyTorch ops) draws:
every comparison that decides the token is made with a margin wider than the two
computations can differ by. A row it cannot certify (a comparison inside the margin, a tie
with the drawn token under top_p, a non-finite logit) comes back as None, for the batched
sampler's PyTorch path to draw. So the tokens are bit for bit the reference's, and that path
runs on a few rows in 10^5 (tests/test_sampling_kernel.py counts them).
"""
from __future__ import annotations

import torch

from ..sampling.batch_sampler import CompiledSampling, SampleRow
from . import cpu_kernels

INTS, DOUBLES = 12, 7  # csrc/sampling.cpp: kInts, kDoubles


def compiled_for(device: torch.device) -> CompiledSampling | None:
    """The compiled sampling for logits on `device`, if there is one."""
    if device.type == "cpu" and cpu_kernels.library() is not None:
        return CPU_SAMPLING
    return None


def draw(logits: torch.Tensor, rows: list[SampleRow], uniforms: list[float]) -> list[int | None]:
    """Each row's token from logits[row.row] (float32 or float64, on the CPU), or None where
    the reference path must draw it."""
    if not rows:
        return []
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.dim() != 2:
        return [None] * len(rows)  # not this kernel's: the PyTorch path draws them all
    logits = logits.contiguous()
    vocab = logits.shape[1]
    base, row_bytes = logits.data_ptr(), vocab * logits.element_size()
    f64 = int(logits.dtype == torch.float64)
    ints, doubles = [], []
    keep = []  # tensors made here, alive through the call
    for r, u in zip(rows, uniforms):
        s, p = r.sampler, r.sampler.params
        counts = mask = bias_ids = bias_values = bans = ahead = 0
        n_bias = n_bans = n_ahead = 0
        if s.counts is not None:
            counts, mask = s.counts.data_ptr(), s.prompt_mask.data_ptr()
            if r.ahead:
                keep.append(t := torch.tensor(r.ahead, dtype=torch.int64))
                ahead, n_ahead = t.data_ptr(), len(r.ahead)
        if s.bias_ids is not None:
            bias_ids, bias_values, n_bias = s.bias_ids.data_ptr(), s.bias_values.data_ptr(), len(s.bias_ids)
        if s.num_generated + len(r.ahead) < p.min_tokens and s.banned_until_min_tokens:
            keep.append(t := torch.tensor(s.banned_until_min_tokens, dtype=torch.int64))
            bans, n_bans = t.data_ptr(), len(s.banned_until_min_tokens)
        ints.append((base + r.row * row_bytes, f64, p.top_k, counts, mask, bias_ids, bias_values, n_bias,
                     bans, n_bans, ahead, n_ahead))
        doubles.append((p.temperature, p.min_p, p.top_p, u, p.repetition_penalty, p.frequency_penalty,
                        p.presence_penalty))
    ints_t = torch.tensor(ints, dtype=torch.int64)
    doubles_t = torch.tensor(doubles, dtype=torch.float64)
    tokens = torch.empty(len(rows), dtype=torch.int64)
    cpu_kernels.library().sample_draw(ints_t.data_ptr(), doubles_t.data_ptr(), len(rows), vocab, tokens.data_ptr(),
                                      torch.get_num_threads())
    return [t if t >= 0 else None for t in tokens.tolist()]


def top_logprobs(lp: torch.Tensor, chosen: torch.Tensor, n: int) -> tuple[list[int], list[list[int] | None]]:
    """For rows of log-probabilities lp [G, V] (float32, CPU): each row's rank of chosen[g] and
    its n largest tokens in torch.topk's order, or None where ties leave that order to torch."""
    if lp.device.type != "cpu" or lp.dtype != torch.float32 or lp.dim() != 2:  # not this kernel's
        return ((lp > chosen[:, None]).sum(-1) + 1).tolist(), [None] * len(lp)
    lp, chosen = lp.contiguous(), chosen.to(torch.float32).contiguous()
    groups, vocab = lp.shape
    ranks = torch.empty(groups, dtype=torch.int64)
    top = torch.empty(groups, max(n, 1), dtype=torch.int64)
    tied = torch.empty(groups, dtype=torch.int32)
    cpu_kernels.library().top_logprobs(lp.data_ptr(), groups, vocab, chosen.data_ptr(), n, ranks.data_ptr(),
                                       top.data_ptr(), tied.data_ptr(), torch.get_num_threads())
    tops = top[:, :n].tolist()
    return ranks.tolist(), [None if t else tops[g] for g, t in enumerate(tied.tolist())]


CPU_SAMPLING = CompiledSampling(draw=draw, top_logprobs=top_logprobs)  # one object, not one per step
