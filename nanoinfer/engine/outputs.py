"""What a request gives back: its finish cause, per-request statistics, the outputs users see
(RequestOutput, CompletionOutput) and the deltas a stream yields. The engine's working state
for a sample is engine/sequence.py's Sequence."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from ..sampling import Logprob


class FinishCause(str, Enum):
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    CONTEXT_FULL = "context_full"
    GRAMMAR = "grammar"  # a structured-output constraint is complete: nothing more may follow
    ABORT = "abort"

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: "stop" when the model or a stop rule ended it, "length" when a limit did."""
        if self in (FinishCause.MAX_TOKENS, FinishCause.CONTEXT_FULL):
            return "length"
        return "abort" if self is FinishCause.ABORT else "stop"


@dataclass(slots=True)
class ForwardStat:
    context_len: int  # tokens the forward attended over (cached + new)
    num_tokens: int  # new tokens fed
    seconds: float


@dataclass
class RequestStats:
    prompt_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled
    finished: float | None = None
    forwards: list[ForwardStat] = field(default_factory=list)
    spec_proposed: int = 0  # speculative decoding: guesses checked,
    spec_accepted: int = 0  # of which accepted,
    spec_checks: int = 0  # in this many steps that checked guesses

    @property
    def generated_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first: the decode rate alone."""
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None

    @property
    def e2e_seconds(self) -> float | None:
        return (self.finished or (self.token_times[-1] if self.token_times else self.arrival)) - self.arrival

    def as_dict(self) -> dict:
        itl = self.inter_token_latencies
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": self.ttft,
            "mean_itl_s": sum(itl) / len(itl) if itl else None,
            "decode_tok_per_s": self.decode_tokens_per_s,
            "e2e_s": self.e2e_seconds,
            "forwards": len(self.forwards),
            **spec_figures(self.spec_proposed, self.spec_accepted, self.spec_checks),
        }


def spec_figures(proposed: int, accepted: int, checks: int) -> dict:
    """Speculative decoding's figures: the share of guesses accepted, and the guesses accepted
    per step that checked some (vLLM's mean acceptance length less the bonus token)."""
    return {"spec_proposed_tokens": proposed, "spec_accepted_tokens": accepted, "spec_checks": checks,
            "spec_acceptance_rate": accepted / proposed if proposed else None,
            "spec_mean_accepted_tokens": accepted / checks if checks else None}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    finish_cause: FinishCause | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    token_masks: list[int] = field(default_factory=list)  # 1 sampled, 0 forced (tool output)
    violations: list[str] | None = None  # a relaxed JSON schema's keywords the output breaks


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    stats: list[RequestStats] = field(default_factory=list)  # one per sample
    # With prompt_logprobs: per prompt token (the first None), the token's logprob and the top ones
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling: the prompt's L2-normalised vector


@dataclass
class StreamDelta:
    """What one step added to one sample: the streaming form's unit."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    token_masks: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # on sample 0's first delta, if asked for
    violations: list[str] | None = None  # on the last delta: what the output breaks of a relaxed schema
    stop_reason: int | str | None = None  # on the last delta: the stop token id or stop string that ended it
    embedding: list[float] | None = None  # on the last delta of a pooling request (SamplingParams.pooling)
