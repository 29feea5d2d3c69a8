"""The `Tokenizer`: text <-> token ids and chat prompts for one model, on the `tokenizers` library.

It is built from either source a model comes in:

* a GGUF file's metadata (`from_gguf_metadata`): the pipeline is rebuilt from the vocabulary,
  merges, token types and flags (see `gguf_vocab`);
* a Hugging Face folder (`from_hf_folder`): `tokenizer.json` is used as it is.

Both give the same ids as transformers for the same tokenizer; see `tests/test_tokenizer.py`.
Chat templates are rendered by `chat_template`.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from ..errors import InvalidRequestError, ModelLoadError
from .chat_template import render_chat_template
from .gguf_vocab import tokenizer_args_from_gguf

# Tokens that end a turn in some chat format. llama.cpp finds these by their text and treats them
# as end-of-generation whatever the file's eos id is; so do we, when the vocabulary has them.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<end_of_utterance>",
)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """Encode, decode and chat-format text for one model. Build it with `from_gguf_metadata` or
    `from_hf_folder`."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        use_post_processor: bool = False,
        chat_template: str | dict[str, str] | None = None,
        special_token_strings: dict[str, str] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        # A tokenizer.json may switch on padding/truncation; an engine never wants either.
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = False
        self._backend = backend
        # The same pipeline, except that special tokens in the text are not matched: what
        # `parse_special=False` uses. (The flag lives on the backend object, so it gets its own
        # copy rather than being switched per call, which would race between threads.)
        serialized = backend.to_str()
        self._plain = Backend.from_str(serialized)
        self._plain.encode_special_tokens = True

        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(max(vocab.values(), default=-1) + 1, vocab_size or 0)
        self._tokens: list[str] = [""] * self.vocab_size
        for token, index in vocab.items():
            self._tokens[index] = token
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # With a ByteFallback decoder, <0xXX> tokens are decoded as a group: one invalid byte
        # turns the whole run of byte tokens into U+FFFD. The detokenizer needs to know them.
        decoder = json.dumps(json.loads(serialized).get("decoder"))
        self.byte_fallback_ids: frozenset[int] = frozenset(
            i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token)
        ) if '"ByteFallback"' in decoder else frozenset()

        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = {eos_token_id, *extra_eos_token_ids}
        eos.update(vocab[name] for name in _END_OF_TURN_TOKENS if name in vocab)
        eos.discard(None)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        # With `use_post_processor`, add_special_tokens runs tokenizer.json's post-processor;
        # otherwise we put BOS/EOS around the ids ourselves.
        self._use_post_processor = use_post_processor
        self._prefix = [bos_token_id] if add_bos and bos_token_id is not None else []
        self._suffix = [eos_token_id] if add_eos and eos_token_id is not None else []

        if isinstance(chat_template, dict):
            self._templates = dict(chat_template)
            self.chat_template: str | None = self._templates.get("default")
        else:
            self._templates = {"default": chat_template} if chat_template else {}
            self.chat_template = chat_template or None
        self._special_token_strings = dict(special_token_strings or {})

    # ------------------------------------------------------------------ building

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """Build from a GGUF file's key/value metadata (only the `tokenizer.*` keys are read)."""
        backend, kwargs = tokenizer_args_from_gguf(meta)
        return cls(backend, **kwargs)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model folder: tokenizer.json, plus tokenizer_config.json
        (special tokens, chat_template), chat_template.jinja (wins over the config's template)
        and generation_config.json (more end-of-generation ids)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ModelLoadError(f"cannot read {tokenizer_file}: {_one_line(e)}") from e

        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        strings: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                strings[name] = value
        bos = backend.token_to_id(strings["bos_token"]) if "bos_token" in strings else None
        eos = backend.token_to_id(strings["eos_token"]) if "eos_token" in strings else None

        template: str | dict[str, str] | None = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        template_json = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(template_json, str):
            template = template_json
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        generation = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra_eos = generation if isinstance(generation, list) else [generation] if generation is not None else []
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=[int(i) for i in extra_eos],
            # BOS/EOS come from tokenizer.json's post-processor alone. transformers 5 does the
            # same: it drops add_bos_token/add_eos_token from tokenizer_config.json whenever a
            # tokenizer.json exists (in real repos the two agree).
            use_post_processor=True,
            chat_template=template,
            special_token_strings=strings,
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS (and EOS) where this tokenizer does;
        `parse_special` matches special tokens written in the text (like "<|im_start|>") whole,
        otherwise they are tokenized as the plain text they are. Non-special added tokens (GGUF
        user-defined tokens) are matched whole either way, as in llama.cpp and transformers."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, not {type(text).__name__}")
        backend = self._backend if parse_special else self._plain
        if self._use_post_processor:
            return _encode(backend, text, add_special_tokens)
        ids = _encode(backend, text, False)
        return [*self._prefix, *ids, *self._suffix] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry for id `i`, as stored (e.g. "Ġworld" or "▁world")."""
        if not 0 <= i < self.vocab_size:
            raise InvalidRequestError(f"token id {i} is out of range (vocabulary size {self.vocab_size})")
        return self._tokens[i]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    def vocabulary_source(self) -> tuple[str, Any]:
        return "tokenizers", self._backend.to_str()

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does
        (continue_final_message: the last message, the assistant's, is left open for the model
        to continue). Tools go to the template as they are: see `native_tools` and
        tool_prompt.py for templates that do not render them."""
        template = self._template(bool(tools))
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("each message must be an object with 'role' and 'content'")
        if continue_final_message and (add_generation_prompt or messages[-1].get("role") != "assistant"):
            raise InvalidRequestError("continue_final_message needs the last message from the assistant and "
                                      "add_generation_prompt false", "continue_final_message")
        context = {**self._special_token_strings, **kwargs}  # kwargs may override bos_token etc.
        text = render_chat_template(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    context=context)
        if continue_final_message:
            text = _open_final_message(text, messages[-1].get("content"))
        return text

    def _template(self, tools: bool) -> str:
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            if self._templates:
                raise InvalidRequestError(f"no default chat template; this model has {sorted(self._templates)}")
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        return template

    @cached_property
    def native_tools(self) -> bool:
        """Whether the chat template lists `tools` for the model itself: a one-message chat
        renders differently with a tool than without. False: tools are written in by
        tool_prompt.py (also for a template that cannot render at all: nothing to lose)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = [{"type": "function", "function": {"name": "nanoinfer_probe", "description": "d",
                                                  "parameters": {"type": "object", "properties": {}}}}]
        try:
            args = dict(add_generation_prompt=True, context=dict(self._special_token_strings))
            with_tool = render_chat_template(self._template(True), probe, tools=tool, **args)
            without = render_chat_template(self._template(False), probe, tools=None, **args)
        except InvalidRequestError:
            return False
        return with_tool != without

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        parse_special: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Render and encode a chat. The template writes its own BOS and control tokens, so
        those are parsed and nothing is added (like transformers' tokenize=True). Special-token
        text inside the messages stays plain text (a user cannot write turn markers) unless
        `parse_special`."""
        pattern = None if parse_special else self._special_text
        masked = _mask_special_text(messages, pattern) if pattern else messages
        masked_tools = _mask_special_text(tools, pattern) if pattern and tools else tools  # their text is the user's too
        text = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt, tools=masked_tools,
                                        **kwargs)
        if masked == messages and masked_tools == tools:
            return self.encode(text, add_special_tokens=False, parse_special=True)
        # The template's markers become tokens; the text between them, the messages' included, is
        # encoded as plain text: what parsing does, with the messages' markers left as text.
        ids: list[int] = []
        for i, piece in enumerate(pattern.split(text)):
            if i % 2:
                ids.append(self._backend.token_to_id(piece))
            elif piece:
                ids += self.encode(piece.replace(_MASK, ""), add_special_tokens=False)
        return ids

    @cached_property
    def _special_text(self) -> re.Pattern | None:
        """Matches any special token's text, longest first (a capturing group, for split)."""
        texts = sorted({self._tokens[i] for i in self._special_ids if self._tokens[i]}, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None


_MASK = "\ufdd0"  # a Unicode noncharacter (for internal use): put into special-token text to unmake it


def _open_final_message(text: str, content: Any) -> str:
    """The rendered chat cut right after the last message's text (its end-of-turn markers
    dropped), as transformers' continue_final_message does; templates may strip the text."""
    final = content if isinstance(content, str) else ""
    for probe in (final, final.strip()):
        if probe and probe in text:
            return text[:text.rindex(probe) + len(probe)]
    raise InvalidRequestError("continue_final_message: the last message's text is not in the rendered chat",
                              "continue_final_message")


def _encode(backend: Backend, text: str, add_special_tokens: bool) -> list[int]:
    """tokenizers' `encode` holds the GIL throughout (0.8 s for a megabyte: every other thread of a
    server stalls); `encode_batch` releases it and gives the same ids. Short texts take `encode`."""
    if len(text) < 4096:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _mask_special_text(value: Any, pattern: re.Pattern) -> Any:
    """`value` (messages: dicts, lists, strings) with every special token's text broken by _MASK."""
    if isinstance(value, str):
        return pattern.sub(lambda m: m[0][0] + _MASK + m[0][1:], value)
    if isinstance(value, dict):
        return {k: _mask_special_text(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mask_special_text(v, pattern) for v in value)
    return value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from e
    return data if isinstance(data, dict) else {}


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
