"""Tiny nanochat checkpoints for the tests, built here: nothing is downloaded.

* `build_encoding()`: a tiktoken Encoding trained (byte-level BPE) on a small corpus with
  nanochat's split pattern, its 9 special tokens as the last ids.
* `random_state(era)`: a random state dict with nanochat's keys and dtypes for one era,
  every feature switched on with values far from their neutral ones (lambdas not 1/0,
  gates open, smear and backout active), so a feature left out of a forward shows.
* `write_checkpoint()` / `write_tokenizer()`: nanochat's directory layout.
"""
from __future__ import annotations

import json
import math
import pickle
from collections import Counter
from pathlib import Path

import regex
import tiktoken
import torch

# nanochat's split pattern: GPT-4's, with numbers split into groups of at most two digits.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>",
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Hello, world! How are you today? I'm fine, thanks. What's 12 + 34? It is 46.",
    "日本語のテキストと中文文本。日本語は難しいです。",
    "Emoji: 😀 🎉 👍🏽 ❤️ 😀😀",
    "Café, naïve, résumé, über, jalapeño. Ça va très bien.",
] * 10
NUM_MERGES = 100  # vocab 256 + 100 + 9 = 365, padded to 384 in the model

# The model: small, but with GQA, 4 layers (so backout is not the last layer and the
# value-embedding layers are 1 and 3) and a sequence_len whose short window (128 by
# nanochat's formula) is shorter than the test sequences.
MODEL_CONFIG = {
    "sequence_len": 512, "vocab_size": 256 + NUM_MERGES + len(SPECIAL_TOKENS),
    "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "window_pattern": "SSSL",
}
ERAS = ("A", "B", "C/D", "E", "F")


def train_bpe(texts: list[str], num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: the 256 bytes, then the most frequent adjacent pair, merged, repeatedly."""
    chunks = Counter(piece.encode() for text in texts for piece in regex.findall(SPLIT_PATTERN, text))
    words = {tuple(bytes([b]) for b in chunk): n for chunk, n in chunks.items()}
    ranks = {bytes([i]): i for i in range(256)}
    while len(ranks) < 256 + num_merges:
        pairs: Counter = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))  # ties: deterministic
        ranks.setdefault(a + b, len(ranks))
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return ranks


def build_encoding() -> tiktoken.Encoding:
    ranks = train_bpe(CORPUS, NUM_MERGES)
    specials = {t: len(ranks) + i for i, t in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def write_tokenizer(root: Path, encoding: tiktoken.Encoding | None = None) -> Path:
    path = Path(root) / "tokenizer" / "tokenizer.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(encoding or build_encoding()))  # as nanochat saves it
    return path


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // 64) * 64


def random_state(era: str = "F", config: dict | None = None, seed: int = 0,
                 scalar_shape: tuple[int, ...] = (1,)) -> dict[str, torch.Tensor]:
    """nanochat's state dict for `era`: Linear weights fp32, embeddings bf16 (as saved)."""
    cfg = {**MODEL_CONFIG, **(config or {})}
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    n_layer, d, H, Hkv = cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
    D, V = d // H, padded_vocab(cfg["vocab_size"])
    s: dict[str, torch.Tensor] = {"transformer.wte.weight": randn(V, d).bfloat16()}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        s[p + "attn.c_q.weight"] = randn(H * D, d, std=d ** -0.5)
        s[p + "attn.c_k.weight"] = randn(Hkv * D, d, std=d ** -0.5)
        s[p + "attn.c_v.weight"] = randn(Hkv * D, d, std=d ** -0.5)
        s[p + "attn.c_proj.weight"] = randn(d, H * D, std=d ** -0.5)
        s[p + "mlp.c_fc.weight"] = randn(4 * d, d, std=d ** -0.5)
        s[p + "mlp.c_proj.weight"] = randn(d, 4 * d, std=0.5 * (4 * d) ** -0.5)
    s["lm_head.weight"] = randn(V, d, std=8 * d ** -0.5)  # logits ~8: the softcap bends them
    if era != "A":
        s["resid_lambdas"] = randn(n_layer, std=0.1, mean=0.9)
        s["x0_lambdas"] = randn(n_layer, std=0.1, mean=0.3)
    if era in ("C/D", "E", "F"):
        channels = 32 if era == "C/D" else 12
        for i in range(n_layer):
            if i % 2 == (n_layer - 1) % 2:
                s[f"value_embeds.{i}.weight"] = randn(V, Hkv * D).bfloat16()
                s[f"transformer.h.{i}.attn.ve_gate.weight"] = randn(Hkv, channels, std=0.5)
    if era == "F":
        s["smear_gate.weight"] = randn(1, 24, std=0.5)
        s["smear_lambda"] = torch.full(scalar_shape, 0.7)
        s["backout_lambda"] = torch.full(scalar_shape, 0.4)
    return s


def write_checkpoint(root: Path, source: str, tag: str, step: int, state: dict[str, torch.Tensor],
                     config: dict | None = None, compiled: bool = False, with_step: bool = True) -> Path:
    """<root>/<source>_checkpoints/<tag>/model_<step>.pt + meta_<step>.json (+ an optim file)."""
    folder = Path(root) / f"{source}_checkpoints" / tag
    folder.mkdir(parents=True, exist_ok=True)
    if compiled:  # what torch.compile's wrapper puts in front of every key
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    torch.save(state, folder / f"model_{step:06d}.pt")
    meta = {"model_config": {**MODEL_CONFIG, **(config or {})}, "val_bpb": 1.23}
    if with_step:  # RL checkpoints have no step
        meta["step"] = step
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta))
    torch.save({}, folder / f"optim_{step:06d}_rank0.pt")
    return folder


def short_window(sequence_len: int) -> int:
    return math.ceil(sequence_len / 4 / 128) * 128
