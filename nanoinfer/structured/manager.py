"""One engine's structured outputs: the grammar backend (built on first use: reading a 50k
vocabulary takes llguidance a few hundred milliseconds), compiled constraints cached by their
text, and the step's masks applied to the logits before anything samples from them.

No constraint can take more than its share: compiles run on their own big-stack threads with a
time limit, and a step's masks on worker threads the engine waits for at most
`limits.mask_budget_seconds` (workers.py); a row whose mask is not ready by then, or whose
grammar engine has failed, ends alone with a ConstraintError."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import torch

from ..errors import ConstraintError
from ..sampling import StructuredOutputsParams
from ..tokenizer import TokenizerLike
from .backend import Compiled, GrammarBackend, Matcher, allowed_tokens
from .budget import LOOKAHEAD, MARGIN, JsonCloser, JsonScan
from .limits import ConstraintLimits
from .workers import CompileRunner, MaskWorkers

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped)


class StructuredOutputs:
    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, limits: ConstraintLimits | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or ConstraintLimits()
        self._compiler = CompileRunner()
        self._masks = MaskWorkers()
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._compiling: dict[str, Future] = {}  # key -> the result of the compile under way
        self._lock = threading.Lock()  # compile() is called from the server's worker threads too
        self.mask_seconds = 0.0  # time spent computing and applying masks (the bench reports it)
        self.mask_rows = 0
        self._closer: JsonCloser | None = None

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            from .llguidance_backend import LLGuidanceBackend, make_tokenizer

            eos = sorted(self.tokenizer.eos_token_ids)
            self._backend = LLGuidanceBackend(make_tokenizer(self.tokenizer.vocabulary_source(), self.vocab_size, eos))
        return self._backend

    def warm_up(self) -> None:
        """Build the backend and the JSON closer now. Reading the vocabulary holds the GIL for
        about half a second: a server does it before serving, not while its first constrained
        request waits and every stream stalls."""
        with self._lock:
            self.backend  # noqa: B018 - built on first access
        self.closer  # noqa: B018

    def compile(self, spec: StructuredOutputsParams) -> Compiled:
        """The compiled constraint, from the cache when the same text was compiled before (or is
        being compiled: one compile per text at a time). Raises ConstraintError for a constraint
        the backend cannot handle or that is past the limits (the time its compile and first
        mask take included)."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._compiling.get(key)
            if pending is not None:
                owner = False
            else:
                owner, pending = True, Future()
                self._compiling[key] = pending
                backend = self.backend
        if not owner:
            return pending.result()  # the owner's compile is bounded by the limits
        limits = self.limits
        try:
            compiled = self._compiler.run(lambda: backend.compile(spec, limits),
                                          lambda c: c.first_mask(limits.first_mask_seconds), limits.compile_seconds,
                                          limits.first_mask_seconds, f"structured_outputs.{spec.kind}")
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(e)
            raise
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            del self._compiling[key]
        pending.set_result(compiled)
        return compiled

    @property
    def closer(self) -> JsonCloser:
        if self._closer is None:
            backend = self.backend
            tok = self.tokenizer
            special = {i for i in range(min(tok.vocab_size, self.vocab_size)) if tok.is_special(i)}
            special |= set(range(tok.vocab_size, self.vocab_size))
            self._closer = JsonCloser([backend.token_bytes(i) for i in range(self.vocab_size)], special,
                                      sorted(tok.eos_token_ids))
        return self._closer

    def matcher(self, spec: StructuredOutputsParams) -> Constraint:
        closes = spec.close_within_budget and spec.kind in ("json", "json_object")
        compiled = self.compile(spec)
        return Constraint(compiled.matcher(), self.closer if closes else None, getattr(compiled, "check", None))

    def apply_masks(self, logits: torch.Tensor, rows: list[tuple[int, Constraint, int]]) -> dict[int, ConstraintError]:
        """Set to -inf every logit of rows[i][0] that its constraint disallows (logits: CPU fp32
        [R, V]); rows[i][2] is how many tokens that row may still generate. Returns the rows
        that must end, with why: their mask was not ready within the step's budget, their
        grammar engine failed, or their grammar allows no token at all."""
        t0 = time.perf_counter()
        V = logits.shape[1]
        words = np.zeros((len(rows), (V + 31) // 32), dtype=np.uint32)
        for _, c, remaining in rows:
            c.check_budget(remaining)
        budget = self.limits.mask_budget_seconds
        jobs = self._masks.run([lambda c=c, out=words[i]: c.fill_mask(out) for i, (_, c, _) in enumerate(rows)], budget)
        failed: dict[int, ConstraintError] = {}
        for i, ((r, c, _), job) in enumerate(zip(rows, jobs)):
            why = None
            if job.state == "abandoned":
                why = ConstraintError(f"the structured-output constraint's mask took longer than the step's budget "
                                      f"of {budget * 1000:.0f} ms", code="constraint_too_slow")
            elif job.error is not None or c.error() is not None:
                why = ConstraintError(f"the structured-output constraint failed: {c.error() or job.error}",
                                      code="constraint_failed")
            if why is not None:
                failed[r] = why
                words[i] = 0xFFFFFFFF  # the row ends; its logits stay finite meanwhile
        allowed = allowed_tokens(words, V)
        lg = logits.numpy()
        index = [r for r, _, _ in rows]
        sub = lg[index]
        sub[~allowed] = -np.inf
        lg[index] = sub
        for (r, _, _), ok in zip(rows, allowed.any(axis=1)):
            if not ok and r not in failed:
                failed[r] = ConstraintError("the structured-output constraint allows no next token",
                                            code="constraint_failed")
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += len(rows)
        return failed


class Constraint:
    """One sequence's constraint: its grammar matcher, and for JSON the closing plan it follows
    once its token budget nears its end (budget.py)."""

    __slots__ = ("matcher", "closer", "scan", "plan", "next_check", "margin", "check")

    def __init__(self, matcher: Matcher, closer: JsonCloser | None, check=None):
        self.matcher = matcher
        self.closer = closer
        self.check = check  # the schema's keywords relaxed for decoding, checked on the output (or None)
        self.scan = JsonScan()
        self.plan: list[int] = []  # forced next tokens, once closing started
        self.next_check = LOOKAHEAD  # remaining budget at which to plan again
        self.margin = -1  # room kept for what one free token adds to the plan (set at the first look)

    def check_budget(self, remaining: int) -> None:
        """Start following a closing plan if the value must start closing now to fit."""
        if self.closer is None or self.plan or remaining > self.next_check:
            return
        if self.margin < 0:  # first look: a short request keeps less room
            self.margin = max(2, min(MARGIN, remaining // 8))
        plan = self.closer.plan(self.matcher, self.scan, remaining)
        if plan is None:  # does not fit: the model would have to close more than it writes,
            self.next_check = remaining // 2  # which is rare, so look again only at half the budget
            return
        gap = remaining - len(plan) - self.margin
        if gap <= 0:
            self.plan = plan
        else:  # the plan changes slowly as the model writes: look again when half the gap is used
            self.next_check = remaining - max(1, gap // 2)

    def states_after(self, tokens: list[int]) -> list[Constraint]:
        """The constraint after each of tokens[:1], tokens[:2], ... (for checking proposed
        tokens: the mask at each verified position), as far as the grammar allows them. Copies:
        this one does not move, and the copies have no budget rule (a row speculates only
        while that rule is idle)."""
        states: list[Constraint] = []
        m = self.matcher
        for t in tokens:
            if not m.allows(t):
                break
            m = m.copy()
            m.accept(t)
            if m.is_terminated():  # the row after it would have nothing to allow: it ends the guesses
                break
            states.append(Constraint(m, None, self.check))
        return states

    def budget_rule_idle(self, remaining: int) -> bool:
        """True if the budget rule cannot act while at least `remaining` tokens are left."""
        return self.closer is None or (not self.plan and remaining > LOOKAHEAD)

    def fill_mask(self, out: np.ndarray) -> None:
        if self.plan:
            out[:] = 0
            out[self.plan[0] // 32] = np.uint32(1 << (self.plan[0] % 32))
        else:
            self.matcher.fill_mask(out)

    def accept(self, token: int) -> bool:
        if not self.matcher.accept(token):
            return False
        if self.closer is not None:
            self.scan.feed(self.closer.token_bytes[token])
            if self.plan:
                self.plan = self.plan[1:] if self.plan[0] == token else []
        return True

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def error(self) -> str | None:
        return self.matcher.error()

    def violations(self, text: str) -> list[str] | None:
        """What the finished output violates of the schema's relaxed keywords (None: nothing was relaxed)."""
        return None if self.check is None else self.check.violations(text)
