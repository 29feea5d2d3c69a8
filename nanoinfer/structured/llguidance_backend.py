"""The grammar engine: llguidance (Microsoft's, the one vLLM and SGLang also ship; Rust, one
3 MB wheel with no dependencies). JSON schemas, regexes and Lark grammars compile to one
grammar format; GBNF (llama.cpp's) is converted to Lark. A mask step costs tens of
microseconds for a JSON schema over a 50k vocabulary, computed lazily from the parser state
rather than from a precomputed automaton, so compiling is fast too.

llguidance's own torch helpers are not used: its mask kernel is a torch.compile function
(importing torch._dynamo costs a second); masks are applied with numpy instead."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from ..errors import ConstraintError
from ..sampling import StructuredOutputsParams
from .gbnf import GbnfError, gbnf_to_lark, is_lark
from .limits import ConstraintLimits


def make_tokenizer(source: tuple[str, Any], vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance reads it; vocab_size is the model's (its logits' width)."""
    kind, value = source
    if kind == "tokenizers":
        return llguidance.LLTokenizer(value, n_vocab=vocab_size, eos_token=eos_ids)
    if kind == "tiktoken":
        return llguidance.LLTokenizer.from_tiktoken(encoder=value._mergeable_ranks, special_tokens=value._special_tokens,
                                                    pattern=value._pat_str, eos_token=eos_ids, n_vocab=vocab_size)
    raise ValueError(f"no grammar vocabulary from a {kind!r} tokenizer")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that says nothing
    about extra keys (a copy)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def parser_limits(limits: ConstraintLimits) -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=limits.max_grammar_symbols)


def _grammar_text(spec: StructuredOutputsParams, limits: ConstraintLimits) -> str:
    """The constraint in llguidance's grammar format, after the checks on its size."""
    kind = spec.kind
    param = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        limits.check_schema(schema, param)
        if kind == "json" and spec.disable_additional_properties:
            schema = closed_objects(schema)
        options = ({"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
                   if spec.disable_any_whitespace else {"whitespace_flexible": True})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ConstraintError(f"invalid JSON schema: {e}", param) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    text = spec.grammar
    if is_lark(text):
        limits.check_lark(text, param)
    else:  # GBNF (llama.cpp's) is converted
        try:
            text = gbnf_to_lark(text, limits.max_rules)
        except GbnfError as e:
            code = "constraint_too_large" if "rules" in str(e) else None
            raise ConstraintError(f"invalid GBNF grammar: {e}", param, code=code) from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "error"


class LLGuidanceMatcher:
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher):
        self.m = m

    def fill_mask(self, out: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str | None:
        return _first_line(self.m.get_error()) if self.m.is_error() else None

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def allows(self, token: int) -> bool:
        return self.m.validate_tokens([token]) == 1

    def forced_tokens(self) -> list[int]:
        return self.m.compute_ff_tokens()

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.m.deep_copy())


@dataclass
class LLGuidanceCompiled:
    template: llguidance.LLMatcher  # never advanced: each sequence gets a copy
    kind: str
    vocab_size: int

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())

    def first_mask(self, cpu_seconds: float) -> None:
        """Compute the first mask (on the template: what it builds, its copies find built), timed
        on this thread's CPU clock, so that load elsewhere does not count against it."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
        t0 = time.thread_time()
        self.template.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        spent = time.thread_time() - t0
        param = f"structured_outputs.{self.kind}"
        if self.template.is_error():
            raise ConstraintError(f"the {self.kind} constraint failed at its first token: "
                                  f"{_first_line(self.template.get_error())}", param, code="constraint_failed")
        if spent > cpu_seconds:
            raise ConstraintError(f"the {self.kind} constraint's first mask took {spent * 1000:.0f} ms of CPU time; the "
                                  f"budget is {cpu_seconds * 1000:.0f} ms", param, code="constraint_too_slow")


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def compile(self, spec: StructuredOutputsParams, limits: ConstraintLimits) -> LLGuidanceCompiled:
        param = f"structured_outputs.{spec.kind}"
        m = llguidance.LLMatcher(self.tokenizer, _grammar_text(spec, limits), log_level=0,
                                 limits=parser_limits(limits))
        if m.is_error():
            error = _first_line(m.get_error())
            code = "constraint_too_large" if "too big" in error or "too large" in error else None
            raise ConstraintError(f"invalid {spec.kind} constraint: {error}", param, code=code)
        return LLGuidanceCompiled(m, spec.kind, self.tokenizer.vocab_size)
