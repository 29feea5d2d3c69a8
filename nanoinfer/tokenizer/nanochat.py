"""nanochat's tokenizer: a tiktoken Encoding pickled to `tokenizer.pkl`, plus its chat rendering.

The pickle is never loaded with plain `pickle.load`: a file a user hands us could name any
global and run it. A restricted unpickler lets through only what a pickled
`tiktoken.Encoding` references, catches the Encoding's state instead of letting tiktoken
rebuild itself, and the Encoding is then built here from the four checked fields.

Text is always encoded with `encode_ordinary`: special-token text typed by a user stays
plain text, so only the renderer can put control tokens into a prompt.
"""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tiktoken

from ..errors import InvalidRequestError, ModelLoadError
from .byte_level import BYTE_TO_UNICODE, UNICODE_TO_BYTE

# The last 9 ids of every nanochat vocabulary, in this order.
SPECIAL_TOKENS = (
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>",
)


# ---------------------------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------------------------

class _EncodingState:
    """Stands in for tiktoken.core.Encoding while unpickling: BUILD hands it the Encoding's
    state (via __setstate__), and nothing of tiktoken runs."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Object:
    """Stands in for builtins.object, which protocol 0/1 pickles name as the base class."""


def _reconstructor(cls: Any, base: Any, state: Any) -> _EncodingState:
    # copyreg._reconstructor(cls, object, None) is how protocols 0 and 1 create an instance.
    if cls is not _EncodingState or base is not _Object or state is not None:
        raise ModelLoadError("tokenizer.pkl carries something other than a tiktoken Encoding: copyreg._reconstructor")
    return _EncodingState()


def _latin1_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    # Protocols < 3 pickle bytes as _codecs.encode(str, "latin1"); no other codec is needed.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ModelLoadError("tokenizer.pkl carries something other than a tiktoken Encoding: _codecs.encode")
    return text.encode("latin-1")


_ALLOWED_GLOBALS = {
    ("tiktoken.core", "Encoding"): _EncodingState,
    ("tiktoken", "Encoding"): _EncodingState,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("copy_reg", "_reconstructor"): _reconstructor,  # protocol 0/1 spell it the Python 2 way
    ("builtins", "object"): _Object,
    ("__builtin__", "object"): _Object,
    ("_codecs", "encode"): _latin1_bytes,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise ModelLoadError(f"tokenizer.pkl carries something other than a tiktoken Encoding: {module}.{name}")
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise ModelLoadError("tokenizer.pkl carries something other than a tiktoken Encoding: a persistent id")


def load_encoding(path: str | Path) -> tiktoken.Encoding:
    """Read a pickled tiktoken Encoding without running anything the file names."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _RestrictedUnpickler(f).load()
    except ModelLoadError:
        raise
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # truncated or garbled pickles raise many kinds of error
        raise ModelLoadError(f"{path}: not a readable pickle ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if not isinstance(obj, _EncodingState):
        raise ModelLoadError(f"{path}: holds a {type(obj).__name__}, not a tiktoken Encoding")
    state = obj.state
    if isinstance(state, str):  # tiktoken pickles its registered encodings by name only
        raise ModelLoadError(f"{path}: refers to the registered encoding {state!r} by name; nanochat pickles the full state")
    fields = ("name", "pat_str", "mergeable_ranks", "special_tokens")
    if not isinstance(state, dict) or any(k not in state for k in fields):
        raise ModelLoadError(f"{path}: the Encoding state lacks {', '.join(fields)}")
    name, pat_str, ranks, specials = (state[k] for k in fields)
    if not (isinstance(name, str) and isinstance(pat_str, str)
            and isinstance(ranks, dict) and all(isinstance(k, bytes) and type(v) is int for k, v in ranks.items())
            and isinstance(specials, dict) and all(isinstance(k, str) and type(v) is int for k, v in specials.items())):
        raise ModelLoadError(f"{path}: the Encoding state has fields of the wrong types")
    try:
        return tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:  # e.g. a split pattern the regex engine rejects
        raise ModelLoadError(f"{path}: tiktoken rejects the Encoding ({' '.join(str(e).split())})") from None


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

class NanochatTokenizer:
    """The engine's tokenizer interface (nanoinfer.tokenizer.TokenizerLike) over a tiktoken
    Encoding, with nanochat's conversation rendering instead of a Jinja chat template."""

    native_tools = False  # nanochat takes no tool definitions (its calculator is built in)

    chat_template: str | None = None
    # Byte-level BPE decodes bytes first and replaces invalid UTF-8 once, so the streaming
    # detokenizer needs no byte-fallback bookkeeping (its trailing-U+FFFD hold-back suffices).
    byte_fallback_ids: frozenset[int] = frozenset()

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.encoding = encoding
        specials = encoding._special_tokens
        missing = [t for t in SPECIAL_TOKENS if t not in specials]
        if missing:
            raise ModelLoadError(f"not a nanochat tokenizer: special tokens {', '.join(missing)} are missing")
        self.special_ids: dict[str, int] = {t: specials[t] for t in SPECIAL_TOKENS}
        self._special_set = frozenset(specials.values())
        self._id_to_special = {i: t for t, i in specials.items()}
        self._ranks: dict[bytes, int] = encoding._mergeable_ranks
        self.vocab_size: int = encoding.n_vocab
        if len(self._ranks) + len(specials) != self.vocab_size:
            raise ModelLoadError(f"tokenizer ids are not contiguous: {len(self._ranks)} tokens and "
                                 f"{len(specials)} specials in a vocabulary of {self.vocab_size}")
        ids = self.special_ids
        self.bos_token_id: int = ids["<|bos|>"]
        self.eos_token_id: int = ids["<|assistant_end|>"]
        # Generation stops at the end of the assistant's turn, or if it starts a new document.
        self.eos_token_ids: frozenset[int] = frozenset({self.eos_token_id, self.bos_token_id})

    @classmethod
    def from_pickle(cls, path: str | Path) -> NanochatTokenizer:
        return cls(load_encoding(path))

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """`add_special_tokens` puts <|bos|> in front, as nanochat starts every document;
        `parse_special` matches special-token text whole (off: it stays plain text)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, not {type(text).__name__}")
        if parse_special:
            ids = self.encoding.encode(text, allowed_special="all", disallowed_special=())
        else:
            ids = self.encoding.encode_ordinary(text)
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids outside the vocabulary (e.g. the model's padding rows) decode to nothing.
        keep = [i for i in ids if 0 <= i < self.vocab_size and not (skip_special_tokens and i in self._special_set)]
        return self.encoding.decode_bytes(keep).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        """Special tokens as their text; others as byte-level BPE strings ("Ġworld"), which
        keep every byte (a token may hold part of a UTF-8 character)."""
        if not 0 <= i < self.vocab_size:
            raise InvalidRequestError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        if i in self._id_to_special:
            return self._id_to_special[i]
        return "".join(BYTE_TO_UNICODE[b] for b in self.encoding.decode_single_token_bytes(i))

    def token_to_id(self, token: str) -> int | None:
        if token in self.encoding._special_tokens:
            return self.encoding._special_tokens[token]
        if not token or any(c not in UNICODE_TO_BYTE for c in token):
            return None
        return self._ranks.get(bytes(UNICODE_TO_BYTE[c] for c in token))

    def is_special(self, i: int) -> bool:
        return i in self._special_set

    def vocabulary_source(self) -> tuple[str, Any]:
        return "tiktoken", self.encoding

    # ------------------------------------------------------------------ chat

    def render_conversation(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """nanochat's rendering: token ids and a mask (1 = tokens the assistant produced,
        which a trainer would learn from; 0 = prompt, user text and tool output)."""
        s = self.special_ids
        ids: list[int] = [self.bos_token_id]
        mask: list[int] = [0]

        def add(tokens: int | list[int], m: int) -> None:
            tokens = [tokens] if isinstance(tokens, int) else tokens
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        for i, message in enumerate(_merge_system(messages)):
            role, content = message["role"], message["content"]
            if role == "user":
                add(s["<|user_start|>"], 0)
                add(self.encode(_user_text(content, i), add_special_tokens=False), 0)
                add(s["<|user_end|>"], 0)
            else:
                add(s["<|assistant_start|>"], 0)
                for kind, text in _assistant_parts(content, i):
                    tokens = self.encode(text, add_special_tokens=False)
                    if kind == "text":
                        add(tokens, 1)
                    elif kind == "python":  # the model writes the tool call: learned, mask 1
                        add(s["<|python_start|>"], 1)
                        add(tokens, 1)
                        add(s["<|python_end|>"], 1)
                    else:  # python_output: the tool wrote it, not the model
                        add(s["<|output_start|>"], 0)
                        add(tokens, 0)
                        add(s["<|output_end|>"], 0)
                add(s["<|assistant_end|>"], 1)
        return ids, mask

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """The prompt for a reply: the conversation (last message from the user) followed by
        <|assistant_start|>. Without `add_generation_prompt`, just the rendered conversation."""
        if tools:
            raise InvalidRequestError("nanochat models take no tool definitions (the calculator is built in)")
        ids, _ = self.render_conversation(messages)
        if add_generation_prompt:
            if _merge_system(messages)[-1]["role"] != "user":
                raise InvalidRequestError("the last message must be from the user for the assistant to reply")
            ids.append(self.special_ids["<|assistant_start|>"])
        return ids

    def render_for_completion(self, messages: list[dict]) -> list[int]:
        """nanochat's own prompt builder: the conversation ends with the assistant message to be
        completed, which is dropped and replaced by <|assistant_start|>."""
        messages = list(messages)
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise InvalidRequestError("render_for_completion needs a conversation that ends with an assistant message")
        ids, _ = self.render_conversation(messages[:-1])
        return [*ids, self.special_ids["<|assistant_start|>"]]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The rendered prompt as text, special tokens written out (for display and logs)."""
        return self.decode(self.encode_chat(messages, add_generation_prompt, tools), skip_special_tokens=False)


def _merge_system(messages: Sequence[dict]) -> list[dict]:
    """Check the roles, and fold a leading system message into the first user message
    (nanochat has no system turn: `system + "\\n\\n" + user`)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} must be an object with 'role' and 'content'")
    out = [dict(m) for m in messages]
    if out[0]["role"] == "system":
        if len(out) < 2 or out[1]["role"] != "user":
            raise InvalidRequestError("a system message must be followed by a user message")
        system = _user_text(out[0]["content"], 0)
        out = [{**out[1], "content": system + "\n\n" + _user_text(out[1]["content"], 1)}, *out[2:]]
    for i, m in enumerate(out):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise InvalidRequestError(
                f"message {i} has role {m['role']!r} where {expected!r} is expected: nanochat conversations "
                f"alternate user and assistant, starting with user (one optional system message first)")
    return out


def _user_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    # OpenAI-style content parts, text only.
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"message {i}: content must be a string or a list of text parts")


def _assistant_parts(content: Any, i: int) -> list[tuple[str, str]]:
    if isinstance(content, str):
        return [("text", content)]
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("text", "python", "python_output")
                    and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"message {i}: assistant parts must be "
                                          "{'type': 'text' | 'python' | 'python_output', 'text': str}")
            parts.append((part["type"], part["text"]))
        return parts
    raise InvalidRequestError(f"message {i}: assistant content must be a string or a list of parts")
