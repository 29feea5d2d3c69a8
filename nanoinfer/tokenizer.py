"""Text <-> token ids, chat templates, streaming detokenization and stop strings.

One `Tokenizer` class, built on the `tokenizers` library, from either source a model comes in:

* a GGUF file's metadata (`from_gguf_metadata`): llama.cpp stores the vocabulary, merges, token
  types and flags, not a `tokenizer.json`, so the pipeline is rebuilt here from those facts
  ("gpt2": byte-level BPE with a pre-tokenizer regex picked by `tokenizer.ggml.pre`;
  "llama": sentencepiece-style BPE with byte fallback);
* a Hugging Face folder (`from_hf_folder`): `tokenizer.json` is used as it is.

Both give the same ids as transformers for the same tokenizer; see `tests/test_tokenizer.py`.
"""
from __future__ import annotations

import json
import logging
import re
import string
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from nanoinfer.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn in some chat format. llama.cpp finds these by their text and treats them
# as end-of-generation whatever the file's eos id is; so do we, when the vocabulary has them.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<end_of_utterance>",
)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer split regexes for byte-level BPE, by `tokenizer.ggml.pre`.
# The names and regexes are llama.cpp's (src/llama-vocab.cpp); where llama.cpp rewrote a regex
# for std::regex, the original from the model's tokenizer.json is used, as `tokenizers` (Oniguruma)
# runs it as written. A value is a list: each regex splits the pieces the previous one made.
# ---------------------------------------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = r"[一-龥ࠀ-一가-퟿]+"
# Written as code points: some of these letters are "singletons" that Unicode normalization (as
# done by editors and copy-paste) silently turns into other letters, e.g. U+212A KELVIN SIGN -> "K".
_DEEPSEEK_LLM_LETTER_RANGES = (
    "0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF 0370-0373 "
    "0376 0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 048A-052F 0531-0556 "
    "10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15 "
    "1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE "
    "1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 "
    "2119-211D 2124 2126 2128 212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B "
    "2C7E-2CE4 2CEB-2CEE 2CF2 2CF3 A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF "
    "FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 "
    "10CC0-10CF2 118A0-118DF 1E900-1E943"
)
_DEEPSEEK_LLM_LETTERS = r"\s?[" + "".join(
    "-".join(chr(int(cp, 16)) for cp in item.split("-")) for item in _DEEPSEEK_LLM_LETTER_RANGES.split()
) + "]+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {}
for _names, _regexes in [
    # "default" is GPT-2's regex here, as in transformers; llama.cpp's "default" (also used when
    # the key is missing) is an odd 4-regex sequence that no current converter writes.
    (("default", "gpt2", "gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais", "gigachat",
      "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code"), [_GPT2]),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe"), [_LLAMA3]),
    (("qwen2", "stablelm2", "megrez", "deepseek-r1-qwen", "kormo", "f2llmv2"), [_QWEN2]),
    (("qwen35",), [_QWEN35]),
    # Digits one by one, then GPT-2's regex: the pipeline of e.g. SmolLM2's tokenizer.json,
    # Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     [r"\p{N}", _GPT2]),
    (("deepseek-llm",),
     [r"[\r\n]", _DEEPSEEK_LLM_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK, r"\p{N}+"]),
    (("deepseek-coder",), [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"]),
    (("deepseek-v3",), [
        r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ]),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    (("bloom", "poro-chat", "gpt3-finnish"), [_BLOOM]),
    (("viking",), [_BLOOM, r"\p{N}"]),
    (("tekken",), [_TEKKEN]),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), [_GPT4O]),
]:
    for _name in _names:
        _PRE_TOKENIZER_SPLITS[_name] = _regexes

# Llama-3-style vocabularies. For these llama.cpp sets `ignore_merges` (a word that is itself in the
# vocabulary is one token, whatever the merges say), as their tokenizer.json does, and adds BOS
# when the file has no add_bos_token flag.
_LLAMA3_STYLE_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"})


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies:
    printable Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onward."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_TO_UNICODE = _byte_to_unicode()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_BYTE_ALPHABET = frozenset(_BYTE_TO_UNICODE.values())


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
        self._byte_fallback_ids = frozenset(
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
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens or not isinstance(tokens, (list, tuple)):
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary")
        tokens = [str(t) for t in tokens]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)]
        if len(types) != len(tokens):
            raise ModelLoadError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        unk, pad = token_id("unknown_token_id"), token_id("padding_token_id")
        pre = str(meta.get("tokenizer.ggml.pre") or "default")

        if kind == "gpt2":
            backend = _byte_level_backend(tokens, types, meta.get("tokenizer.ggml.merges"), pre)
            # BOS as the file's add_bos_token says: llama.cpp and transformers 5's GGUF loader both
            # honour the flag for byte-level vocabularies too (checked in the tests; the SmolLM2
            # file here says false, so no BOS). Without the flag, llama.cpp's default: BOS only for
            # Llama-3-style vocabularies (transformers would add none).
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_STYLE_PRE))
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_backend(tokens, types, scores, meta.get("tokenizer.ggml.merges"), unk, add_prefix)
            # Sentencepiece models add BOS unless the file says not to (llama.cpp and transformers agree).
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")

        # Control tokens, the unknown token and the named special tokens are special: matched whole
        # (with parse_special) and skipped by decode(skip_special_tokens=True). User-defined tokens
        # (like <think>) are always matched whole and always decoded, as in llama.cpp.
        named = {i for i in (bos, eos, unk, pad) if i is not None}
        added = [
            AddedToken(tok, special=typ in (_CONTROL, _UNKNOWN) or i in named, normalized=False)
            for i, (tok, typ) in enumerate(zip(tokens, types))
            if typ in (_CONTROL, _UNKNOWN, _USER_DEFINED) or i in named
        ]
        backend.add_tokens(added)

        templates: dict[str, str] = {}
        prefix = "tokenizer.chat_template."
        for key, value in meta.items():
            if key.startswith(prefix) and isinstance(value, str):
                templates[key[len(prefix):]] = value
        if isinstance(meta.get("tokenizer.chat_template"), str):
            templates["default"] = meta["tokenizer.chat_template"]

        strings = {name: tokens[i] for name, i in (("bos_token", bos), ("eos_token", eos),
                                                    ("unk_token", unk), ("pad_token", pad)) if i is not None}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=[i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None],
            add_bos=add_bos,
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=templates if set(templates) - {"default"} else templates.get("default"),
            special_token_strings=strings,
            vocab_size=len(tokens),
        )

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
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = backend.encode(text, add_special_tokens=False).ids
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

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does."""
        template = self._templates.get("tool_use") if tools else None
        template = template or self._templates.get("default")
        if template is None:
            if self._templates:
                raise InvalidRequestError(f"no default chat template; this model has {sorted(self._templates)}")
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("each message must be an object with 'role' and 'content'")

        compiled = _compile_template(template)
        context = {**self._special_token_strings, **kwargs}  # kwargs may override bos_token etc.
        try:
            return _render_bounded(compiled, dict(
                messages=_normalize_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            ))
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, OverflowError,
                RecursionError) as e:
            raise InvalidRequestError(f"chat template error: {_one_line(e)}") from e

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
        text = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if masked == messages:
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


def _mask_special_text(value: Any, pattern: re.Pattern) -> Any:
    """`value` (messages: dicts, lists, strings) with every special token's text broken by _MASK."""
    if isinstance(value, str):
        return pattern.sub(lambda m: m[0][0] + _MASK + m[0][1:], value)
    if isinstance(value, dict):
        return {k: _mask_special_text(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mask_special_text(v, pattern) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# Backends rebuilt from GGUF metadata
# ---------------------------------------------------------------------------------------------

def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if len(vocab) < len(tokens):
        # A few converted vocabularies repeat an unused entry; only the first id of each is used.
        logger.warning("GGUF vocabulary has %d repeated tokens; keeping the first of each", len(tokens) - len(vocab))
    return vocab


def _parse_merges(merges: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Split at the first space after the first character, as llama.cpp does.
        cut = merge.find(" ", 1)
        if cut < 0:
            continue
        left, right = merge[:cut], merge[cut + 1:]
        # `tokenizers` rejects a merge whose parts or result are not in the vocabulary.
        if left in vocab and right in vocab and left + right in vocab:
            pairs.append((left, right))
    return pairs


def _byte_level_backend(tokens: list[str], types: list[int], merges: Sequence[str] | None, pre: str) -> Backend:
    if not merges:
        raise ModelLoadError("GGUF 'gpt2' tokenizer has no tokenizer.ggml.merges")
    spelled = []
    for token, typ in zip(tokens, types):
        # Ordinary tokens are stored in GPT-2's byte alphabet; one that is not (rare) is respelled
        # so BPE can produce it. Control and user-defined tokens keep their raw text: they are
        # matched on the raw input as added tokens.
        if typ in (_CONTROL, _USER_DEFINED, _UNKNOWN) or set(token) <= _BYTE_ALPHABET:
            spelled.append(token)
        else:
            spelled.append("".join(_BYTE_TO_UNICODE[b] for b in token.encode("utf-8")))
    vocab = _vocab_dict(spelled)
    pairs = _parse_merges(merges, vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_STYLE_PRE))
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for GGUF `tokenizer.ggml.pre` = `pre`: split with its regexes, then map
    bytes to GPT-2's byte alphabet. An unknown name gets GPT-2's regex, with a warning."""
    regexes = _PRE_TOKENIZER_SPLITS.get(pre)
    if regexes is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with GPT-2's regex", pre)
        regexes = [_GPT2]
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _merges_from_scores(tokens: list[str], types: list[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Sentencepiece stores no merges: a piece is made from two smaller pieces, preferring the
    pieces with the highest score. As BPE merges: every split of a piece into two pieces that
    exist, ranked by the whole piece's score (ties: longer left part, then longer right part;
    then vocabulary order), which is how transformers recovers them."""
    ids: dict[str, int] = {}
    for i, (token, typ) in enumerate(zip(tokens, types)):
        # Only ordinary pieces take part: sentencepiece never builds <s>, <0x0A> or <unk> from text.
        if typ in (_NORMAL, _USER_DEFINED, _UNUSED):
            ids.setdefault(token, i)
    ranked = []
    for piece, i in ids.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        ranked.extend((float(scores[i]), left, right) for left, right in splits)
    ranked.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))  # stable: ties keep vocabulary order
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_backend(
    tokens: list[str],
    types: list[int],
    scores: Sequence[float] | None,
    merges: Sequence[str] | None,
    unk: int | None,
    add_prefix: bool,
) -> Backend:
    vocab = _vocab_dict(tokens)
    if merges:
        pairs = _parse_merges(merges, vocab)
    else:
        # No scores at all: earlier pieces are taken to be the more frequent ones.
        pairs = _merges_from_scores(tokens, types, scores if scores else [-float(i) for i in range(len(tokens))])
    unk_token = tokens[unk] if unk is not None else None
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    # Like HF's LlamaTokenizerFast with legacy=False: spaces become ▁, and a ▁ is put in front of
    # the text unless it starts with one; not in front of text that follows a special token.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False,
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the ▁ that encode put in front
    backend.decoder = decoders.Sequence(steps)
    return backend


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


# ---------------------------------------------------------------------------------------------
# Chat templates: the Jinja environment transformers renders them in
# ---------------------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering just outputs the body, but templates using it must still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    # The sandbox blocks reading underscore attributes; this blocks storing them too.
    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    if (len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0) > _TOJSON_MAX_INDENT:
        raise _TemplateLimitError(f"tojson indent {indent!r:.20} is over {_TOJSON_MAX_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# A chat template is a model file's code, run for every request. Every string or list it builds
# and its output stay under _TEMPLATE_MAX_LEN items, integers under _TEMPLATE_MAX_BITS bits
# (checked before an operation allocates, not after), and rendering stops after _TEMPLATE_SECONDS
# (checked at every loop iteration and call, the only ways a template can run long).
_TEMPLATE_MAX_LEN = 1 << 24
_TEMPLATE_MAX_BITS = 1 << 16
_TEMPLATE_SECONDS = 2.0
_render_deadline: ContextVar[float] = ContextVar("_render_deadline", default=float("inf"))
_TOJSON_MAX_INDENT = 64
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A chat template went past one of the bounds above."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_len(n: int, what: str = "a string") -> None:
    if n > _TEMPLATE_MAX_LEN:
        raise _TemplateLimitError(f"the template would build {what} of length {n} (limit {_TEMPLATE_MAX_LEN})")


def _check_time() -> None:
    if time.monotonic() > _render_deadline.get():
        raise _TemplateLimitError(f"rendering took over {_TEMPLATE_SECONDS:g} s")


def _bounded_iter(iterable: Iterable) -> Iterator:
    for item in iterable:
        _check_time()
        yield item


def _check_width(digits: str | None) -> None:
    if digits == "*":
        raise _TemplateLimitError("'*' widths in % formats are not allowed in chat templates")
    if digits and (len(digits) > 9 or int(digits) > _TEMPLATE_MAX_LEN):
        _check_len(int(digits[:10]), "a formatted field")


def _check_printf(fmt: str) -> None:
    for m in _PRINTF_FIELD.finditer(fmt):
        for digits in m.groups():
            _check_width(digits)


def _check_format(fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise _TemplateLimitError("nested fields in format specs are not allowed in chat templates")
        for digits in re.findall(r"\d+", spec or ""):
            _check_width(digits)


def _replaced_len(s: str, old: str, new: str, count: Any = -1) -> int:
    n = len(s) + 1 if old == "" else s.count(old)
    if _is_int(count) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _joined_len(sep: str, items: list) -> int:
    return len(sep) * max(len(items) - 1, 0) + sum(len(x) for x in items if isinstance(x, str))


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_For(self, node: jinja2.nodes.For, frame: jinja2.compiler.Frame) -> None:
        # `for x in xs` iterates environment.bounded_iter(xs), which checks the time
        node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                                      lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        # `a ~ b`: through the environment, to be bounded like `+` (the base class calls a helper)
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders templates in, with the operations that can build a
    huge value from small ones (repetition, powers, concatenation, padding, replace, join,
    format widths) checked against the bounds first."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    bounded_iter = staticmethod(_bounded_iter)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if _sized(left) and _is_int(right) or _sized(right) and _is_int(left):
                seq, n = (left, right) if _sized(left) else (right, left)
                _check_len(len(seq) * n, "a string" if isinstance(seq, str) else "a list")
            elif _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > _TEMPLATE_MAX_BITS:
                raise _TemplateLimitError(f"the template would build an integer over {_TEMPLATE_MAX_BITS} bits")
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > _TEMPLATE_MAX_BITS:
                raise _TemplateLimitError(f"the template would build an integer over {_TEMPLATE_MAX_BITS} bits")
        elif operator == "+" and _sized(left) and _sized(right):
            _check_len(len(left) + len(right), "a string" if isinstance(left, str) else "a list")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left)
        try:
            return super().call_binop(context, operator, left, right)
        except OverflowError:  # float ** int and the like: "(34, 'Numerical result out of range')"
            raise _TemplateLimitError(f"numeric overflow in {operator!r}") from None

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_time()  # macros (which may recurse) and methods
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name in ("center", "ljust", "rjust", "zfill") and args and _is_int(args[0]):
                _check_len(args[0])
            elif name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                _check_len(len(owner) + owner.count("\t") * (tab if _is_int(tab) else 0))
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _check_len(_replaced_len(owner, *args[:3]))
            elif name == "join" and len(args) == 1:
                items = list(args[0])
                _check_len(_joined_len(owner, items))
                args = (items,)
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(value.__self__)
        return wrapper

    @staticmethod
    def bounded_concat(values: tuple) -> str:
        parts = [str(v) for v in values]
        _check_len(sum(map(len, parts)))
        return "".join(parts)


# Jinja's filters that can build a huge value from small arguments, checked first.

def _center(value: Any, width: int = 80) -> str:
    if _is_int(width):
        _check_len(width)
    return jinja2.filters.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(s)
    pad = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    _check_len(len(text) + (text.count("\n") + 1) * pad)
    return jinja2.filters.do_indent(s, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    _check_printf(str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _join(eval_ctx: jinja2.nodes.EvalContext, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)
    _check_len(_joined_len(str(d), items))
    return jinja2.filters.do_join(eval_ctx, items, d, attribute)


@jinja2.pass_eval_context
def _replace(eval_ctx: jinja2.nodes.EvalContext, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    _check_len(_replaced_len(str(s), str(old), str(new), -1 if count is None else count))
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


@jinja2.pass_environment
def _wordwrap(environment: jinja2.Environment, s: Any, width: int = 79, break_long_words: bool = True,
              wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
    text = str(s)
    lines = len(text) // max(width, 1) + text.count("\n") + 1 if _is_int(width) else len(text)
    _check_len(len(text) + lines * len(wrapstring or environment.newline_sequence))
    return jinja2.filters.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    if _is_int(linecount):
        _check_len(linecount, "a batch")
    return jinja2.filters.do_batch(value, linecount, fill_with)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    if _is_int(slices):
        _check_len(slices, "a list of slices")
    return jinja2.filters.do_slice(value, slices, fill_with)


_BOUNDED_FILTERS = {"center": _center, "indent": _indent, "format": _format, "join": _join, "replace": _replace,
                    "wordwrap": _wordwrap, "batch": _batch, "slice": _slice, "tojson": _tojson}


def _render_bounded(template: jinja2.Template, context: dict[str, Any]) -> str:
    """template.render(context) within the bounds on output size and time."""
    token = _render_deadline.set(time.monotonic() + _TEMPLATE_SECONDS)
    out, size = [], 0
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > _TEMPLATE_MAX_LEN:
                raise _TemplateLimitError(f"the template's output is over {_TEMPLATE_MAX_LEN} characters")
            _check_time()
            out.append(chunk)
    finally:
        _render_deadline.reset(token)
    return "".join(out)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters.update(_BOUNDED_FILTERS)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except (jinja2.TemplateSyntaxError, RecursionError) as e:
        raise InvalidRequestError(f"chat template does not compile: {_one_line(e)}") from e


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """What transformers does to messages before rendering: drop keys whose value is None (APIs
    send `content: null` with tool calls), and expose reasoning under each name templates read."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time.

    Decoding one token alone is wrong in general (a character can be split over several byte
    tokens; sentencepiece drops the space in front of the first token), so each step decodes a
    short window of recent ids and emits what the new id added to it. Text that may still change
    is held back: a trailing U+FFFD (possibly a character still missing bytes), and with a
    byte-fallback decoder the text of a trailing run of <0xXX> tokens, which the decoder turns
    into U+FFFDs as a whole if a later byte makes the run invalid UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer._byte_fallback_ids
        self.ids: list[int] = []
        self._start = 0        # the window is ids[_start:]
        self._emitted = 0      # characters of decode(window) already returned
        self._clean_end = 0    # len(ids) when everything decoded so far had been returned

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self.ids[start:stop], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes (often "")."""
        self.ids.append(token_id)
        stable = self._stable_end()
        text = self._decode(self._start, stable)
        ready = text.rstrip("\ufffd")
        delta = ready[self._emitted:]
        self._emitted = max(self._emitted, len(ready))
        if stable == len(self.ids) and len(ready) == len(text):  # nothing held back
            self._slide_window(self._clean_end)
            self._clean_end = len(self.ids)
        return delta

    def _stable_end(self) -> int:
        """Where the trailing run of byte tokens begins (len(ids) if there is none). Ids that
        decode to nothing (skipped specials, ids outside the vocabulary) vanish before the
        decoder runs, so a run continues across them."""
        if not self._byte_ids:
            return len(self.ids)
        end, has_bytes = len(self.ids), False
        while end > self._start:
            token = self.ids[end - 1]
            if token in self._byte_ids:
                has_bytes = True
            elif not self._vanishes(token):
                break
            end -= 1
        return end if has_bytes else len(self.ids)

    def _vanishes(self, token: int) -> bool:
        tok = self._tokenizer
        return (self._skip and tok.is_special(token)) or not 0 <= token < tok.vocab_size or not tok._tokens[token]

    def _slide_window(self, start: int) -> None:
        # Restart the window at an earlier clean boundary (a character boundary), keeping it
        # short. The window must begin with text already returned: if it began with ids that
        # decode to nothing (skipped specials), a start-of-text rule (sentencepiece's dropped
        # leading space) would hit the next token, which is not at the start of the real text.
        if start <= self._start:
            return
        text = self._decode(start)
        if text and not text.startswith("\ufffd"):
            self._start, self._emitted = start, len(text)

    def flush(self) -> str:
        """Whatever is still held back; an incomplete character comes out as U+FFFD."""
        text = self._decode(self._start)
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, also when one is split over several pieces.

    `feed` returns the text that can be shown now. The end of the text that could be the
    beginning of a stop string is held back until it is clear; on a match, the text before the
    stop string is returned and the rest (the stop string and anything after it) is dropped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._held + text
        found = [(buffer.find(s), s) for s in self._stops]
        hits = [(at, s) for at, s in found if at >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            self.stopped, self.matched, self._held = True, stop, ""
            return buffer[:at], True
        keep = self._longest_partial(buffer)
        cut = len(buffer) - keep
        self._held = buffer[cut:]
        return buffer[:cut], False

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is the beginning of a stop string.
        Only places where a stop string's first character occurs are tried, each with one
        C-level comparison, so a step costs about one scan of the held text per stop string."""
        longest = 0
        for stop in self._stops:
            at = buffer.find(stop[0], max(len(buffer) - len(stop) + 1, 0))
            while 0 <= at < len(buffer) - longest:
                if stop.startswith(buffer[at:]):
                    longest = len(buffer) - at
                    break
                at = buffer.find(stop[0], at + 1)
        return longest

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
