"""vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model: the draft's path (any format nanoinfer loads; the target's vocabulary)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Steps with at least this many decoding sequences do not speculate (vLLM's
    # speculative_disable_by_batch_size): a batch that large keeps the CPU busy computing, so
    # checking guesses costs more than the weight reads it saves.
    disable_by_batch_size: int = 4
    # What checking guesses costs is measured (spec_decode/policy.py: decode steps' times by
    # row count); until a row count is measured, a step with k guesses is taken to cost
    # 1 + verify_cost * k single-token steps (0.45: 4 rows of Q4_K blocks on a 2-core AVX2
    # CPU). Each step a sequence has as many guesses checked as pay for themselves at its
    # running acceptance rate, up to num_speculative_tokens; verify_cost 0: always all of
    # them, unmeasured. A sequence that stopped guessing tries one guess again every
    # `retry_after` steps.
    verify_cost: float = 0.45
    retry_after: int = 16

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a dict", param="speculative_config")
        try:
            return cls(**value)
        except TypeError as e:
            raise InvalidRequestError(f"speculative_config: {e}", param="speculative_config") from None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative_config method {self.method!r}: one of {', '.join(METHODS)}",
                                      param="speculative_config.method")
        ints = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                "retry_after")
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"speculative_config {name}={value!r} must be an integer >= 1",
                                          param=f"speculative_config.{name}")
        if not isinstance(self.verify_cost, (int, float)) or isinstance(self.verify_cost, bool) \
                or not 0.0 <= self.verify_cost <= 16.0:
            raise InvalidRequestError(f"speculative_config verify_cost={self.verify_cost!r} must be in [0, 16]",
                                      param="speculative_config.verify_cost")
        if (self.method == "draft_model") != (self.model is not None):
            raise InvalidRequestError("speculative_config model: a path with method draft_model, none otherwise",
                                      param="speculative_config.model")
        if self.model is not None and not isinstance(self.model, str):
            raise InvalidRequestError("speculative_config model must be a path", param="speculative_config.model")
        if self.num_speculative_tokens > 16:
            raise InvalidRequestError("speculative_config num_speculative_tokens must be at most 16",
                                      param="speculative_config.num_speculative_tokens")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError("speculative_config prompt_lookup_min must be <= prompt_lookup_max",
                                      param="speculative_config.prompt_lookup_min")
