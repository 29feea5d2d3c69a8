"""Sampling parameters (vLLM's names and meanings) and the per-row sampler."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError

MAX_STOP_STRINGS = 64  # a stop string is matched on every token: bounded, so one request cannot slow all
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch.Generator takes


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = until the context is full
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per sampled token (OpenAI semantics)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop={_show(self.stop)} must be a string or a list of strings", param="stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop_token_ids={_show(self.stop_token_ids)} must be a list of integers",
                                      param="stop_token_ids")
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        num = lambda name, lo, hi: _number(getattr(self, name)) and lo <= getattr(self, name) <= hi  # noqa: E731
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", num("temperature", 0.0, 100.0), "must be in [0, 100]"),
            ("top_p", num("top_p", 0.0, 1.0) and self.top_p > 0.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be 0 or -1 (off) or a positive integer"),
            ("min_p", num("min_p", 0.0, 1.0), "must be in [0, 1]"),
            ("presence_penalty", num("presence_penalty", -2.0, 2.0), "must be in [-2, 2]"),
            ("frequency_penalty", num("frequency_penalty", -2.0, 2.0), "must be in [-2, 2]"),
            ("repetition_penalty", num("repetition_penalty", 0.0, 10.0) and self.repetition_penalty > 0.0,
             "must be in (0, 10]"),
            ("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "must be an integer >= 1"),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens), "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "must be in [0, 20]"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(x, str) for x in self.stop),
             f"must be at most {MAX_STOP_STRINGS} strings"),
            ("stop", all(len(x) <= MAX_STOP_LENGTH for x in self.stop if isinstance(x, str)),
             f"must be strings of at most {MAX_STOP_LENGTH} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"must be at most {MAX_STOP_TOKEN_IDS} non-negative integers"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name}={_show(getattr(self, name))} {rule}", param=name)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids must name tokens of the model that serves the request."""
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab_size})",
                                      param="stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _show(value) -> str:
    """A value for an error message: floats in full (a subnormal must not read "0.0"), long lists cut."""
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(_show, value[:8]))}, ... ({len(value)} items)]"
    if isinstance(value, str) and len(value) > 64:
        return repr(value[:64] + "...")
    return repr(value)


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
    num_generated: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        if self.params.uses_penalties:
            self.counts = torch.zeros(self.vocab_size)
            self.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            ids = torch.tensor([i for i in self.prompt_ids if i < self.vocab_size], dtype=torch.long)
            self.prompt_mask[ids] = True

    @property
    def takes_argmax(self) -> bool:
        """Greedy with nothing that changes the logits first: the row's token is its argmax,
        which the engine takes for all such rows in one reduction."""
        return self.params.greedy and self.counts is None and not (
            self.num_generated < self.params.min_tokens and self.banned_until_min_tokens)

    def sample(self, logits: torch.Tensor, argmax: int | None = None) -> tuple[int, dict[int, Logprob] | None]:
        """logits: [vocab] fp32 for this row; argmax: its argmax if already known (only
        used when takes_argmax). Returns the token and, if asked, its logprobs."""
        p = self.params
        raw = logits
        if argmax is not None and self.takes_argmax:
            token = argmax
        elif p.greedy:
            token = int(torch.argmax(self.process(logits)))
        else:
            token = self.draw(scale(self.process(logits), p.temperature))
        self.num_generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        return token, (self.logprobs(raw, token) if p.logprobs is not None else None)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties and the min_tokens ban. In float64 when penalties apply: a repetition
        penalty of 1e-38 divides a logit of 5 to 5e38, past float32's range."""
        p = self.params
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
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            # drop a token when the mass before it already reaches top_p; the first always stays
            drop = (cum - torch.softmax(sorted_logits, -1)) >= p.top_p
            drop[0] = False
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

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
