"""Speculative decoding: proposers guess the next tokens of a sequence, and the engine checks
every guess in the same forward as the other rows' work (engine/core.py).

- `SpeculativeConfig` (config.py): vLLM's `speculative_config`, validated.
- `NgramProposer` (ngram.py): prompt lookup, the last n tokens matched against earlier text.
- `worth_checking` (policy.py): how many guesses pay for their check, per sequence and step,
  from the decode step times the engine measures (`StepTimes`).
- The draft-model proposer runs a model, so it lives with the engine (engine/draft.py); both
  implement `Proposer` (proposer.py).

Exactness lives in the engine: a proposed token is accepted exactly when it equals the token
the target samples at that position, sampled as it would be without speculation (same logits
bit for bit, same sampler state), so outputs are the same with speculation on or off."""
from .config import SpeculativeConfig
from .ngram import NgramProposer
from .policy import StepTimes, updated_accept_rate, worth_checking
from .proposer import Proposer, SeqKey

__all__ = ["NgramProposer", "Proposer", "SeqKey", "SpeculativeConfig", "StepTimes", "updated_accept_rate", "worth_checking"]
