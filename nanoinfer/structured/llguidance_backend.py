"""The grammar engine: llguidance (Microsoft's, the one vLLM and SGLang also ship; Rust, one
3 MB wheel with no dependencies). JSON schemas, regexes and Lark grammars compile to one
grammar format; GBNF (llama.cpp's) is converted to Lark. A mask step costs tens of
microseconds for a JSON schema over a 50k vocabulary, computed lazily from the parser state
rather than from a precomputed automaton, so compiling is fast too.

llguidance's own torch helpers are not used: its mask kernel is a torch.compile function
(importing torch._dynamo costs a second); masks are applied with numpy instead."""
from __future__ import annotations

import json
import re
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


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def relaxed(schema: Any, keywords: set[str], formats: set[str]) -> Any:
    """The schema without `keywords` and without `format`s the grammar engine does not know (a copy)."""
    if isinstance(schema, list):
        return [relaxed(s, keywords, formats) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: relaxed(v, keywords, formats) for k, v in schema.items()
            if k not in keywords and not (k == "format" and v in formats)}


def _unenforceable(error: str) -> tuple[set[str], set[str]]:
    """The keywords and formats an error says llguidance cannot enforce."""
    keys = {k.strip().strip('"') for m in _UNIMPLEMENTED.finditer(error) for k in m.group(1).split(",") if k.strip()}
    return keys, set(_UNKNOWN_FORMAT.findall(error))


def _grammar_text(spec: StructuredOutputsParams, limits: ConstraintLimits, drop: tuple[set[str], set[str]] = (set(), set())
                  ) -> str:
    """The constraint in llguidance's grammar format, after the checks on its size; `drop`: the
    schema keywords and formats left out (see LLGuidanceBackend.compile)."""
    kind = spec.kind
    param = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        limits.check_schema(schema, param)
        if drop[0] or drop[1]:
            schema = relaxed(schema, *drop)
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


class SchemaCheck:
    """The whole schema, checked on a finished output whose decoding enforced only part of it."""

    def __init__(self, schema: Any, relaxed: list[str]):
        self.schema, self.relaxed = schema, relaxed

    def violations(self, text: str) -> list[str]:
        import jsonschema  # only for schemas that needed relaxing

        try:
            value = json.loads(text)
        except ValueError:
            return []  # cut short (max_tokens, a stop): not JSON; finish_reason says why
        validator = jsonschema.validators.validator_for(self.schema)(self.schema)
        out = []
        for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
            where = "/" + "/".join(map(str, error.absolute_path))
            out.append(f"{error.validator} at {where}: {' '.join(error.message.split())[:200]}")
        return out[:16]


@dataclass
class LLGuidanceCompiled:
    template: llguidance.LLMatcher  # never advanced: each sequence gets a copy
    kind: str
    vocab_size: int
    check: SchemaCheck | None = None  # the schema's relaxed keywords, checked after decoding

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
        """A JSON schema with keywords llguidance cannot enforce is compiled without them (each
        error names the next ones; a few rounds at most) unless spec.strict; the compiled
        constraint then checks the finished output against the whole schema."""
        param = f"structured_outputs.{spec.kind}"
        keywords: set[str] = set()
        formats: set[str] = set()
        for _ in range(8):
            m = llguidance.LLMatcher(self.tokenizer, _grammar_text(spec, limits, (keywords, formats)), log_level=0,
                                     limits=parser_limits(limits))
            if not m.is_error():
                break
            error = _first_line(m.get_error())
            more = _unenforceable(error)
            if spec.kind != "json" or spec.strict or not (more[0] - keywords or more[1] - formats):
                code = "constraint_too_large" if "too big" in error or "too large" in error else None
                hint = " (not enforceable while decoding; without strict it is relaxed and checked after)" \
                    if spec.strict and (more[0] or more[1]) else ""
                raise ConstraintError(f"invalid {spec.kind} constraint: {error}{hint}", param, code=code)
            keywords |= more[0]
            formats |= more[1]
        checker = SchemaCheck(spec.json, sorted(keywords) + [f"format: {f}" for f in sorted(formats)]) \
            if keywords or formats else None
        return LLGuidanceCompiled(m, spec.kind, self.tokenizer.vocab_size, checker)
