"""One sample's working state in the engine: its tokens, text and stop policy, with the
engine's state of it grouped by concern (KV placement, scheduling, speculation). What it
gives back is in engine/outputs.py."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ConstraintError
from ..sampling import Logprob, RowSampler, SamplingParams
from ..structured import Constraint
from ..tokenizer import IncrementalDetokenizer, StopMatcher
from ..tools.tool_use import ToolUseState
from .outputs import CompletionOutput, FinishCause, RequestStats, StreamDelta


@dataclass
class KVPlacement:
    """Where a sequence's keys and values are: written by the scheduler through the KV
    manager, read by the runner (and the draft model's copy of a sequence has its own)."""

    # one block table per KV group (attention/kv_cache.py), indexed alike by logical block; empty
    # until the KV manager first places the sequence
    block_tables: list[list[int]] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose keys and values are in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # prefix hashes of its full blocks

    @property
    def block_table(self) -> list[int]:
        """The first group's table: the full-attention layers' (a model's only group unless some
        layers have a sliding window shorter than the context)."""
        return self.block_tables[0] if self.block_tables else []


@dataclass
class SchedulingState:
    """What the scheduler and its policy (engine/policy.py) know of a sequence."""

    priority: int = 0  # vLLM's: lower is served first under the priority policy
    arrival: int = 0  # the scheduler's count when its request arrived (forks share their parent's)
    paused: bool = False  # its reader is behind: not scheduled (its blocks kept) until it catches up
    num_preemptions: int = 0


@dataclass
class Speculation:
    """Its speculative decoding: the guesses checked in this step's forward (spec_decode)."""

    tokens: list[int] = field(default_factory=list)  # proposed next tokens
    states: list[Constraint] = field(default_factory=list)  # under a grammar: its state after each of them
    accept_rate: float = 1.0  # running chance that a guess is accepted (spec_decode.policy)
    idle_steps: int = 0  # steps without guesses since it chose none


@dataclass
class Sequence:
    """One sample of one request as it moves through the engine."""

    request_id: str
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RowSampler
    detok: IncrementalDetokenizer
    stop_matcher: StopMatcher
    eos_ids: frozenset[int]
    max_model_len: int
    tool_use: ToolUseState | None = None
    grammar: Constraint | None = None  # its structured-output constraint, advanced token by token
    # the output so far
    output_ids: list[int] = field(default_factory=list)
    output_mask: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_cause: FinishCause | None = None
    stop_reason: int | str | None = None
    # With params.prompt_logprobs: one entry per prompt token so far (the first None: nothing predicts it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # handed out with a delta already
    # With params.pooling: the final hidden states of the prompt positions it pools, in order
    # (mean: every position; last: the last one), then the embedding made of them
    hidden_rows: list[torch.Tensor] = field(default_factory=list)
    pooled_positions: int = 0  # leading positions whose rows are taken (mean), or all of them (last)
    embedding: list[float] | None = None
    forks: list[Sequence] = field(default_factory=list)  # samples 1..n-1, forked after this one's prefill
    # the engine's state of it, one object per concern
    kv: KVPlacement = field(default_factory=KVPlacement)
    sched: SchedulingState = field(default_factory=SchedulingState)
    spec: Speculation = field(default_factory=Speculation)
    stats: RequestStats = field(init=False)
    stop_ids: frozenset[int] = field(init=False)  # params.stop_token_ids, looked up every token

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.stats = RequestStats(len(self.prompt_ids))
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:  # the samples share one prompt
            self.prompt_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still needs the logits of prompt positions (each predicts the next prompt token)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def needs_every_position(self) -> bool:
        """Its prompt's every position must run through the model: nothing read from the prefix cache."""
        return self.wants_prompt_logprobs or self.params.pooling == "mean"

    def hidden_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Of the positions [start, end) that a step runs, those whose hidden states it pools
        and has not taken yet (a preemption runs some again)."""
        pooling, p = self.params.pooling, len(self.prompt_ids)
        if pooling is None or self.pooled_positions >= p:
            return None
        first = max(start, self.pooled_positions) if pooling == "mean" else p - 1
        last = min(end, p)
        return (first, last - first) if last > first else None

    def take_hidden(self, first: int, rows: torch.Tensor) -> None:
        if first != self.pooled_positions and self.params.pooling == "mean":
            return  # taken already
        self.hidden_rows.append(rows.float())
        self.pooled_positions = first + len(rows)

    def finish_scored(self) -> StreamDelta:
        """max_tokens 0: the prompt was scored or pooled; nothing is generated."""
        if self.params.pooling is not None:
            rows = torch.cat(self.hidden_rows)
            pooled = rows[-1] if self.params.pooling == "last" else rows.mean(0)
            self.embedding = torch.nn.functional.normalize(pooled, dim=0).tolist()
            self.hidden_rows = []
        self.finish_cause = FinishCause.MAX_TOKENS
        self.stats.finished = time.perf_counter()
        return self.delta("", [], None)

    @property
    def finished(self) -> bool:
        return self.finish_cause is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens_left(self) -> int:
        """How many more tokens it may generate: max_tokens, then the context window."""
        left = self.max_model_len - self.length
        if self.params.max_tokens is not None:
            left = min(left, self.params.max_tokens - len(self.output_ids))
        return left

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    def append(self, token: int, logprobs: dict[int, Logprob] | None) -> StreamDelta:
        """Take a sampled token, apply the stop policy and tool use, and return what is new."""
        self.stats.token_times.append(time.perf_counter())
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token].logprob
        text = self._take(token, 1)
        tokens = [token]
        if not self.finished and self.tool_use is not None:
            for forced in self.tool_use.after_token(token):
                text += self._take(forced, 0)
                tokens.append(forced)
                if self.finished:
                    break
        if self.finished:
            text += self.release_held_text()
        self.text += text
        return self.delta(text, tokens, logprobs)

    def _take(self, token: int, mask: int) -> str:
        """Append one output token; return its new text; set finish_cause if it ends the sequence."""
        self.output_ids.append(token)
        self.output_mask.append(mask)
        if self.grammar is not None and not self.grammar.accept(token):
            why = self.grammar.error()
            if why is not None:  # the grammar engine gave up (a limit): the constraint's doing
                raise ConstraintError(f"the structured-output constraint failed: {why}", code="constraint_failed")
            raise RuntimeError(f"token {token} breaks the request's structured-output constraint")
        p = self.params
        text = ""
        if mask and token in self.eos_ids and not p.ignore_eos:
            self.finish_cause = FinishCause.EOS
        elif mask and token in self.stop_ids:
            self.finish_cause, self.stop_reason = FinishCause.STOP_TOKEN, token
        else:
            text, stopped = self.stop_matcher.feed(self.detok.add(token))
            if stopped:
                self.finish_cause, self.stop_reason = FinishCause.STOP_STRING, self.stop_matcher.matched
        if self.finish_cause is None and self.grammar is not None and self.grammar.is_terminated():
            self.finish_cause = FinishCause.GRAMMAR
        if self.finish_cause is None:
            if p.max_tokens is not None and len(self.output_ids) >= p.max_tokens:
                self.finish_cause = FinishCause.MAX_TOKENS
            elif self.length >= self.max_model_len:
                self.finish_cause = FinishCause.CONTEXT_FULL
        return text

    def release_held_text(self) -> str:
        """At the end, text the detokenizer or the stop matcher held back belongs to the output,
        unless a stop string matched (everything from it on is dropped)."""
        if self.finish_cause is FinishCause.STOP_STRING:
            return ""
        text, stopped = self.stop_matcher.feed(self.detok.flush())
        if stopped:
            self.finish_cause, self.stop_reason = FinishCause.STOP_STRING, self.stop_matcher.matched
            return text
        return text + self.stop_matcher.flush()

    def abort(self) -> StreamDelta:
        self.finish_cause = FinishCause.ABORT
        self.stats.finished = time.perf_counter()
        return self.delta("", [], None)

    def delta(self, text: str, token_ids: list[int], logprobs) -> StreamDelta:
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent and not self.wants_prompt_logprobs:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return StreamDelta(self.request_id, self.index, text, token_ids, self.finished,
                           self.finish_cause.finish_reason if self.finished else None,
                           [logprobs] if logprobs is not None else None,
                           self.output_mask[len(self.output_mask) - len(token_ids):], prompt_logprobs,
                           self.violations() if self.finished else None,
                           self.stop_reason if self.finished else None, self.embedding)

    def violations(self) -> list[str] | None:
        if self.grammar is None or self.finish_cause in (FinishCause.ABORT, None):
            return None
        return self.grammar.violations(self.text)

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, list(self.output_ids),
            self.finish_cause.finish_reason if self.finished else None, self.finish_cause, self.stop_reason,
            self.logprobs, self.cumulative_logprob if self.logprobs is not None else None, list(self.output_mask),
            self.violations(),
        )
