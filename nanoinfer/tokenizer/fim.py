"""Fill-in-the-middle prompts: the vocabulary's FIM tokens around a prefix and a suffix.

Code models trained for infilling read `<prefix marker> prefix <suffix marker> suffix <middle
marker>` and write the middle (the prefix-suffix-middle order all the families below use). The
markers are special tokens whose names differ by family; a vocabulary without them cannot infill.
"""
from __future__ import annotations

from dataclasses import dataclass

from .protocol import TokenizerLike

# (prefix, suffix, middle) marker names by family
FAMILIES = [
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma, Granite
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # Code Llama (SentencePiece)
    ("<PRE>", "<SUF>", "<MID>"),
]


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int


def fim_tokens(tokenizer: TokenizerLike) -> FimTokens | None:
    for names in FAMILIES:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return FimTokens(*ids)
    return None


def fim_prompt(tokenizer: TokenizerLike, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """BOS where the model starts with one, then prefix marker, prefix, suffix marker, suffix,
    middle marker (as llama.cpp's infill builds it). The texts stay plain text: a marker written
    in them is not a marker."""
    bos = [t for t in tokenizer.encode("", add_special_tokens=True) if t not in tokenizer.eos_token_ids]
    return [*bos, fim.prefix, *tokenizer.encode(prefix, add_special_tokens=False), fim.suffix,
            *tokenizer.encode(suffix, add_special_tokens=False), fim.middle]
