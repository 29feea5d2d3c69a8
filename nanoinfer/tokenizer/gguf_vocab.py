"""Rebuilding a `tokenizers` pipeline from a GGUF file's `tokenizer.*` metadata.

llama.cpp stores the vocabulary, merges, token types and flags, not a `tokenizer.json`, so the
pipeline is rebuilt here from those facts:

* "gpt2": byte-level BPE with a pre-tokenizer regex picked by `tokenizer.ggml.pre` (the table
  below, llama.cpp's names);
* "llama": sentencepiece-style BPE with byte fallback, merges recovered from the scores when the
  file has none.

`tokenizer_args_from_gguf` returns the backend and the rest of what `Tokenizer` is built with
(special ids, BOS/EOS flags, chat templates); `Tokenizer.from_gguf_metadata` calls it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from ..errors import ModelLoadError
from .byte_level import BYTE_TO_UNICODE

logger = logging.getLogger("nanoinfer.tokenizer")

# llama.cpp's token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

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

_BYTE_ALPHABET = frozenset(BYTE_TO_UNICODE.values())


# ---------------------------------------------------------------------------------------------
# The metadata: vocabulary, special ids, flags, chat templates
# ---------------------------------------------------------------------------------------------

def tokenizer_args_from_gguf(meta: dict) -> tuple[Backend, dict[str, Any]]:
    """The backend and `Tokenizer`'s keyword arguments for a GGUF file's key/value metadata
    (only the `tokenizer.*` keys are read)."""
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
    return backend, dict(
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=[i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None],
        add_bos=add_bos,
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=templates if set(templates) - {"default"} else templates.get("default"),
        special_token_strings=strings,
        vocab_size=len(tokens),
    )


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
            spelled.append("".join(BYTE_TO_UNICODE[b] for b in token.encode("utf-8")))
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
