"""The grammar engine: llguidance (Microsoft's, the one vLLM and SGLang also ship; Rust, one
3 MB wheel with no dependencies). JSON schemas, regexes and Lark grammars compile to one
grammar format; GBNF (llama.cpp's) is converted to Lark. A mask step costs tens of
microseconds for a JSON schema over a 50k vocabulary, computed lazily from the parser state
rather than from a precomputed automaton, so compiling is fast too.

llguidance's own torch helpers are not used: its mask kernel is a torch.compile function
(importing torch._dynamo costs a second); masks are applied with numpy instead."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from ..errors import InvalidRequestError
from ..sampling import StructuredOutputsParams


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


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint in llguidance's grammar format."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        if kind == "json" and spec.disable_additional_properties:
            schema = closed_objects(schema)
        options = ({"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
                   if spec.disable_any_whitespace else {"whitespace_flexible": True})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise InvalidRequestError(f"invalid JSON schema: {e}", param=f"structured_outputs.{kind}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        text = any_to_lark(spec.grammar)  # GBNF (llama.cpp's) is converted; Lark passes through
    except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for bad input
        raise InvalidRequestError(f"invalid GBNF grammar: {e}", param="structured_outputs.grammar") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


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

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def compile(self, spec: StructuredOutputsParams) -> LLGuidanceCompiled:
        grammar = _grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {error.strip()}",
                                      param=f"structured_outputs.{spec.kind}")
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {m.get_error()}",
                                      param=f"structured_outputs.{spec.kind}")
        return LLGuidanceCompiled(m)
