"""What the engine, the server, the tools and the streaming detokenizer may ask of a tokenizer.

Both tokenizers satisfy it: `Tokenizer` (GGUF vocabularies and tokenizer.json) and
`NanochatTokenizer` (tiktoken). Code outside this package uses these members only.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TokenizerLike(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]  # every id that ends generation (EOS, end-of-turn tokens)
    chat_template: str | None      # the default Jinja template, None if there is none (nanochat)
    # Ids of <0xXX> tokens whose decoder turns a whole run of them into U+FFFDs if one byte
    # makes the run invalid UTF-8 (a ByteFallback decoder); empty otherwise. The streaming
    # detokenizer holds such a run back until it is complete.
    byte_fallback_ids: frozenset[int]
    # Whether the chat template writes `tools` into the prompt itself; else they are written in
    # by tool_prompt.py, in the <tool_call> format.
    native_tools: bool

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token text stays plain text unless `parse_special`."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ...

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry for id `i`, as stored ("" for an id with no entry)."""
        ...

    def token_to_id(self, token: str) -> int | None:
        ...

    def is_special(self, i: int) -> bool:
        ...

    def vocabulary_source(self) -> tuple[str, Any]:
        """The vocabulary in a form a grammar engine reads it (structured outputs):
        ("tokenizers", tokenizer.json's text) or ("tiktoken", the tiktoken Encoding)."""
        ...

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """The prompt ids for a chat (the model's own format); kwargs go to the template."""
        ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The rendered chat as text."""
        ...
