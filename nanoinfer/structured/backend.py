"""What the engine asks of a grammar engine: compile a constraint once (cached by its text),
give each constrained sequence a matcher of its own, and per step the mask of allowed tokens;
the budget rule (budget.py) also checks single tokens on copies of a matcher.

One implementation today (llguidance_backend.py); xgrammar would be another set of classes
with the same members. Compiling is the slow part (milliseconds to seconds for a large
schema), so callers compile before a request reaches the engine loop (`StructuredOutputs.compile`
from the server's worker threads, or `LLM.generate` before its first step); it runs on a thread
of its own with a large stack and a time limit (workers.py), within limits.py's limits."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..sampling import StructuredOutputsParams
from .limits import ConstraintLimits


def allowed_tokens(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Masks as matchers fill them (uint32 words, [..., (V + 31) // 32]) -> bool [..., V]."""
    return np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size].astype(bool)


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` (uint32 words, bit t % 32 of word t // 32)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance over a sampled (or forced) token; False if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the output ends here."""
        ...

    def error(self) -> str | None:
        """Why the matcher stopped working (a limit of the grammar engine hit, ...), or None."""
        ...

    def is_accepting(self) -> bool:
        """The output could end here (an end-of-sequence token is allowed)."""
        ...

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (without advancing)."""
        ...

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here (may be empty)."""
        ...

    def copy(self) -> Matcher:
        """An independent matcher in the same state."""
        ...


class Compiled(Protocol):
    """A compiled constraint; `matcher()` is cheap and independent of other matchers. `check`,
    if not None, has `relaxed` (the schema keywords decoding does not enforce) and
    `violations(text)` (what a finished output breaks of the whole schema)."""

    check: object | None

    def matcher(self) -> Matcher:
        ...

    def first_mask(self, cpu_seconds: float) -> None:
        """Compute the first mask; ConstraintError if the grammar engine fails at it or it takes
        more than `cpu_seconds` of this thread's CPU time."""
        ...


class GrammarBackend(Protocol):
    name: str

    def token_bytes(self, token: int) -> bytes:
        """The text a token stands for, as the grammar engine reads it."""
        ...

    def compile(self, spec: StructuredOutputsParams, limits: ConstraintLimits) -> Compiled:
        """Raises ConstraintError (with the spec's field as param) for a constraint the backend
        cannot handle or that is past `limits`."""
        ...
