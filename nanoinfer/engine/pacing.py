"""How many prompt tokens a step may prefill while others decode, so that decoding streams
keep their cadence (Sarathi-Serve's stall-free batching, sized by time rather than tokens).

A step that carries decodes and a prefill chunk takes about as long as its tokens cost, so a
512-token chunk beside eight decodes stops all eight streams for the chunk's whole prefill
(on two CPU cores, over a second). The pacer keeps a running estimate of a step's cost per
token, from the steps that ran, and gives prefill chunks what is left of a time target once
the decodes are counted: a step then takes about the target. A step with nothing to decode is
not bounded (no stream waits on it), so a burst of prompts still prefills at full width.

On a GPU a step's time hardly grows with its tokens, the chunk is the token budget's, and the
target is never reached.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_OBSERVED_TOKENS = 16  # a step this small measures overhead more than per-token cost


@dataclass
class StepPacer:
    target_s: float | None = None  # a step's time target; None: the token budget alone
    min_chunk: int = 16  # a prefill always advances at least this much (or its budget)
    seconds_per_token: float | None = None  # running estimate, from steps of MIN_OBSERVED_TOKENS or more

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` (forward and logits)."""
        if tokens < MIN_OBSERVED_TOKENS or seconds <= 0:
            return
        per = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = per if old is None else 0.7 * old + 0.3 * per

    def prefill_budget(self, decode_tokens: int, budget: int) -> int:
        """Prompt tokens this step may prefill, out of `budget`, beside `decode_tokens` decodes."""
        if self.target_s is None or decode_tokens == 0 or self.seconds_per_token is None:
            return budget
        room = int(self.target_s / self.seconds_per_token) - decode_tokens
        return min(budget, max(self.min_chunk, room))
