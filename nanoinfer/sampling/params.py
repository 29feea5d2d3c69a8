"""Sampling parameters: vLLM's names and meanings, checked once, here."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidRequestError

MAX_STOP_STRINGS = 64  # a stop string is matched on every token: bounded, so one request cannot slow all
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar: compiled per request, so bounded
MAX_CHOICES = 1024
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch.Generator takes
POOLING = ("last", "mean")  # how SamplingParams.pooling makes one vector of a prompt


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object` (any JSON object), `regex` (the whole output
    matches it), `choice` (the output is one of these strings) or `grammar` (Lark, or GBNF as
    llama.cpp writes it). JSON is compact by default (`disable_any_whitespace`, vLLM's flag,
    on here): a small model cannot then spend its token budget on runs of blank lines."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    # An object schema that does not say `additionalProperties` allows none (xgrammar's strict
    # mode, vLLM's default backend; OpenAI's strict schemas say it outright): otherwise a small
    # model invents extra keys and runs out of tokens inside them.
    disable_additional_properties: bool = True
    # A JSON value still open when the token budget nears its end is closed by the shortest
    # valid route rather than cut off (structured/budget.py): finish_reason "stop", valid JSON.
    close_within_budget: bool = True
    # A JSON schema keyword the grammar engine cannot enforce while decoding (uniqueItems,
    # contains, not, an unknown format, ...) is relaxed for decoding and checked on the finished
    # output, which reports what it violates; strict=True refuses such a schema instead.
    strict: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured_outputs needs exactly one of json, json_object, regex, choice, "
                                      f"grammar (got {', '.join(given) or 'none'})", param="structured_outputs")
        kind = given[0]
        value = getattr(self, kind)
        param = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=param) from None
                except RecursionError:
                    raise InvalidRequestError("the JSON schema is nested too deeply", param=param) from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequestError("the JSON schema must be an object", param=param)
            try:
                text = json.dumps(value, sort_keys=True)
            except RecursionError:
                raise InvalidRequestError("the JSON schema is nested too deeply", param=param) from None
            self.json = value
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequestError("json_object must be true", param=param)
            text = ""
        elif kind == "choice":
            if not (isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in value)):
                raise InvalidRequestError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings", param=param)
            self.choice = list(value)
            text = json.dumps(self.choice)
        else:
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f"{kind} must be a non-empty string", param=param)
            text = value
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"the {kind} constraint is longer than {MAX_CONSTRAINT_CHARS} characters",
                                      param=param)
        for flag in ("disable_any_whitespace", "disable_additional_properties", "close_within_budget", "strict"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequestError(f"{flag} must be true or false", param=f"structured_outputs.{flag}")
        self._kind, self._text = kind, text

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._kind

    @property
    def key(self) -> str:
        """What identifies the compiled grammar (the cache key)."""
        return (f"{self._kind}:{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
                f"{int(self.strict)}:{self._text}")


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
    prompt_logprobs: int | None = None  # top-N alternatives per prompt token (vLLM's; 0: the token's own only)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict is taken as its fields
    # An embedding: the prompt's final normalised hidden states pooled ("last": the last
    # position's; "mean": all positions' average) and L2-normalised; needs max_tokens=0.
    pooling: str | None = None

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
        if isinstance(self.logit_bias, dict):  # OpenAI sends the ids as JSON object keys: strings
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise InvalidRequestError(f"structured_outputs: {e}", param="structured_outputs") from None
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams or a dict of its fields",
                                      param="structured_outputs")
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
            ("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1)
             or (self.max_tokens == 0 and self.scoring),
             "must be an integer >= 1 (0 only with prompt_logprobs or pooling: scoring)"),
            ("pooling", self.pooling is None or (self.pooling in POOLING and self.max_tokens == 0 and self.n == 1),
             f"must be one of {', '.join(POOLING)}, with max_tokens=0 and n=1"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20), "must be in [0, 20]"),
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= 1024
                                                       and all(_number(b) and -100 <= b <= 100
                                                               for b in self.logit_bias.values())),
             "must map at most 1024 token ids to numbers in [-100, 100]"),
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
        bad = next((t for t in (self.logit_bias or ()) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")

    @property
    def scoring(self) -> bool:
        """Asks for something of the prompt itself (its logprobs, its pooled hidden states):
        max_tokens may be 0 (prefill only, generate nothing)."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Penalties or a logit bias: the row's logits change before its token is chosen."""
        return self.uses_penalties or bool(self.logit_bias)

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
