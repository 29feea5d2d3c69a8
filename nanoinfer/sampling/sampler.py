"""A row's sampling state (its parameters, its own generator, its token counts) and the
per-row definition of sampling: logit bias, penalties, temperature, min_p / top_k / top_p, a
draw from the row's own generator, and the logprobs users see. The engine samples a step's
rows together through batch_sampler.py, which equals this definition bit for bit."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .params import SamplingParams


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely under the model


@dataclass
class RowSampler:
    """One sequence's sampling state: its parameters, its own random generator (so a
    seeded request gives the same tokens whatever else runs beside it) and the token
    counts the penalties need."""

    params: SamplingParams
    vocab_size: int
    prompt_ids: list[int]
    banned_until_min_tokens: list[int] = field(default_factory=list)  # eos / stop ids
    generator: torch.Generator = field(init=False)
    counts: torch.Tensor | None = field(init=False, default=None)
    prompt_mask: torch.Tensor | None = field(init=False, default=None)
    bias_ids: torch.Tensor | None = field(init=False, default=None)  # logit_bias as two tensors
    bias_values: torch.Tensor | None = field(init=False, default=None)
    num_generated: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        if self.params.uses_penalties:
            self.counts = torch.zeros(self.vocab_size)
            self.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            ids = torch.tensor([i for i in self.prompt_ids if i < self.vocab_size], dtype=torch.long)
            self.prompt_mask[ids] = True
        if self.params.logit_bias:
            self.bias_ids = torch.tensor(list(self.params.logit_bias), dtype=torch.long)
            self.bias_values = torch.tensor(list(self.params.logit_bias.values()), dtype=torch.float32)

    def takes_argmax_after(self, ahead: int = 0) -> bool:
        """Greedy with nothing that changes the logits first (once `ahead` more tokens are
        sampled): the row's token is its argmax, which the engine takes for all such rows in
        one reduction."""
        return self.params.greedy and self.keeps_logits_after(ahead)

    def keeps_logits_after(self, ahead: int = 0) -> bool:
        """process() leaves the logits as they are (once `ahead` more tokens are sampled): no
        penalties, no logit bias, no min_tokens ban in force."""
        return not self.params.changes_logits and not (
            self.num_generated + ahead < self.params.min_tokens and self.banned_until_min_tokens)

    def commit(self, token: int, generator_state: torch.Tensor | None = None) -> None:
        """`token` is this row's next token: count it (penalties, min_tokens) and, when the
        batched sampler drew ahead for guesses that were not taken, rewind the generator."""
        self.num_generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        if generator_state is not None:
            self.generator.set_state(generator_state)

    def sample(self, logits: torch.Tensor, argmax: int | None = None) -> tuple[int, dict[int, Logprob] | None]:
        """One row at a time: the definition the batched sampler (batch_sampler.py) equals bit
        for bit, kept as its reference. logits: [vocab] fp32 for this row; argmax: its argmax
        if already known (only used when takes_argmax_after()). Returns the token and, if
        asked, its logprobs."""
        p = self.params
        raw = logits
        if argmax is not None and self.takes_argmax_after():
            token = argmax
        elif p.greedy:
            token = int(torch.argmax(self.process(logits)))
        else:
            token = self.draw(scale(self.process(logits), p.temperature))
        self.commit(token)
        return token, (self.logprobs(raw, token) if p.logprobs is not None else None)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logit bias (OpenAI's: added to the logits, a masked token stays -inf), penalties
        and the min_tokens ban. In float64 when penalties apply: a repetition penalty of 1e-38
        divides a logit of 5 to 5e38, past float32's range."""
        p = self.params
        if self.bias_ids is not None:
            logits = logits.index_add(0, self.bias_ids, self.bias_values)
        if self.counts is not None:
            logits = logits.double()
            if p.repetition_penalty != 1.0:
                seen = self.prompt_mask | (self.counts > 0)
                penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
                logits = torch.where(seen, penalised, logits)
            logits -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).double()
        if self.num_generated < p.min_tokens and self.banned_until_min_tokens:
            logits = logits.clone()
            logits[self.banned_until_min_tokens] = float("-inf")
        return logits

    def draw(self, logits: torch.Tensor) -> int:
        """Sample after min_p, top_k and top_p filtering (vLLM's order)."""
        p = self.params
        if p.min_p > 0.0:
            probs = torch.softmax(logits, -1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        tokens = None  # None: probs is over the whole vocabulary
        if p.top_p < 1.0:
            tokens, probs = nucleus(probs, p.top_p)
        # inverse-CDF draw from the row's generator: one uniform number per token
        cdf = probs.cumsum(0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64) * cdf[-1]
        i = int(torch.searchsorted(cdf, u, right=True))
        if i == cdf.shape[0]:  # u rounded up to the total: the last token with any mass
            i = int(torch.nonzero(probs).max())
        return int(tokens[i]) if tokens is not None else i

    def logprobs(self, raw: torch.Tensor, token: int) -> dict[int, Logprob]:
        """The model's own distribution (before penalties and temperature), as OpenAI and vLLM report it."""
        lp = torch.log_softmax(raw, -1)
        out: dict[int, Logprob] = {}
        n = self.params.logprobs or 0
        if n:
            top = torch.topk(lp, n)
            for rank, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                out[i] = Logprob(v, rank)
        if token not in out:
            out[token] = Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1)
        return out


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p's tokens and their probabilities, most likely first: a token stays while the mass
    of those before it is below top_p (the first always stays). Found among the top 64, then
    512, ... candidates rather than by sorting the whole vocabulary: the kept set is a prefix
    of the descending order, so once it ends before the candidates do, it is complete."""
    k, V = 64, probs.shape[0]
    while True:
        k = min(k, V)
        vals, ids = torch.topk(probs, k)
        n = max(1, int(((vals.cumsum(0) - vals) < top_p).sum()))
        if n < k or k == V:
            return ids[:n], vals[:n]
        k *= 8


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature for any temperature > 0, in float64, shifted so the largest is 0:
    (logits - max) / T never overflows, and its softmax is that of logits / T. Tokens at +inf
    (a vanishing repetition penalty) share the mass, as they do in the limit."""
    logits = logits.double()
    top = logits.max()
    if torch.isposinf(top):
        return torch.where(torch.isposinf(logits), 0.0, float("-inf")).double()
    if torch.isneginf(top):
        raise ValueError("every token is excluded (min_tokens bans all that remain)")
    return (logits - top) / temperature
