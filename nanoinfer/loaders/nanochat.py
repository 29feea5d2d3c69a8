"""nanochat checkpoints: `<root>/{base,chatsft,chatrl}_checkpoints/<tag>/model_<step>.pt` plus
`meta_<step>.json`, and the tokenizer at `<root>/tokenizer/tokenizer.pkl`.

The architecture changed over time ("eras") and the constants that changed with it are not
stored in the files, so the era is read off the state dict (which tensors exist, and the
value-embedding gate's width) and the constants come from the table below. The user can
override rotary base, q/k scale and softcap (nanochat's era D used softcap 20, which no
tensor reveals).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, check_int
from ..errors import InvalidRequestError, ModelLoadError
from ..tokenizer import NanochatTokenizer

# Preference when the caller names no source: the most trained first. ("mid" is the
# midtraining stage of older nanochat versions.)
SOURCES = ("chatrl", "chatsft", "mid", "base")
REQUIRED_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd")
OVERRIDES = ("rope_theta", "qk_scale", "softcap", "max_position_embeddings")
# Scalars kept in fp32 whatever the served dtype.
SCALARS = ("resid_lambdas", "x0_lambdas", "smear_lambda", "backout_lambda")


@dataclass(frozen=True)
class Era:
    rope_theta: float
    qk_scale: float
    softcap: float
    lambdas: bool  # resid_lambdas / x0_lambdas (else 1 and 0)
    windows: bool  # window_pattern (else every layer long)
    ve_gate_scale: float | None  # value embeddings, gated by scale * sigmoid(...)
    smear_backout: bool


ERAS = {
    "A": Era(10000.0, 1.0, 15.0, lambdas=False, windows=False, ve_gate_scale=None, smear_backout=False),
    "B": Era(10000.0, 1.0, 15.0, lambdas=True, windows=True, ve_gate_scale=None, smear_backout=False),
    "C/D": Era(10000.0, 1.0, 15.0, lambdas=True, windows=True, ve_gate_scale=2.0, smear_backout=False),
    "E": Era(100000.0, 1.15, 15.0, lambdas=True, windows=True, ve_gate_scale=3.0, smear_backout=False),
    "F": Era(100000.0, 1.2, 15.0, lambdas=True, windows=True, ve_gate_scale=3.0, smear_backout=True),
}


# ---------------------------------------------------------------------------------------------
# Finding the files
# ---------------------------------------------------------------------------------------------

_MODEL_FILE = re.compile(r"model_(\d+)\.pt")
_DEPTH_TAG = re.compile(r"d(\d+)")


def _steps(tag_dir: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in tag_dir.glob("model_*.pt") if (m := _MODEL_FILE.fullmatch(p.name))}


def _tags(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and _steps(p))


def _pick_tag(ckpt_dir: Path, tag: str | None) -> Path:
    tags = _tags(ckpt_dir)
    if not tags:
        raise ModelLoadError(f"{ckpt_dir}: no checkpoints (no <tag>/model_<step>.pt)")
    if tag is not None:
        found = [t for t in tags if t.name == tag]
        if not found:
            raise ModelLoadError(f"{ckpt_dir}: no tag {tag!r} (found {', '.join(t.name for t in tags)})")
        return found[0]
    depths = [(int(m.group(1)), t) for t in tags if (m := _DEPTH_TAG.fullmatch(t.name))]
    if depths:  # the deepest model, by number (d12 beats d4)
        return max(depths, key=lambda dt: dt[0])[1]
    return max(tags, key=lambda t: t.stat().st_mtime)  # as nanochat: the newest


def _checkpoint_dirs(root: Path) -> dict[str, Path]:
    return {p.name[: -len("_checkpoints")]: p for p in root.glob("*_checkpoints") if p.is_dir() and _tags(p)}


def find_checkpoint(path: str | Path, step: int | None = None, tag: str | None = None,
                    source: str | None = None) -> tuple[Path, Path, int, str | None]:
    """(model file, meta file, step, source) for a base dir, a `*_checkpoints` dir or a tag dir."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such directory")
    if _steps(path):  # a tag dir
        tag_dir = path
        name = path.parent.name
        src = name[: -len("_checkpoints")] if name.endswith("_checkpoints") else None
    elif path.name.endswith("_checkpoints") or _tags(path) and not _checkpoint_dirs(path):
        tag_dir = _pick_tag(path, tag)
        src = path.name[: -len("_checkpoints")] if path.name.endswith("_checkpoints") else None
    else:  # a base dir
        dirs = _checkpoint_dirs(path)
        if not dirs:
            raise ModelLoadError(f"{path}: no checkpoints (no *_checkpoints/<tag>/model_<step>.pt)")
        if source is not None:
            if source not in dirs:
                raise ModelLoadError(f"{path}: no {source}_checkpoints with a model (found {', '.join(sorted(dirs))})")
            src = source
        else:
            src = next((s for s in SOURCES if s in dirs), sorted(dirs)[0])
        tag_dir = _pick_tag(dirs[src], tag)
    steps = _steps(tag_dir)
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise ModelLoadError(f"{tag_dir}: no step {step} (found {', '.join(map(str, sorted(steps)))})")
    meta = tag_dir / f"meta_{step:06d}.json"
    if not meta.is_file():
        raise ModelLoadError(f"{tag_dir}: {steps[step].name} has no {meta.name}")
    return steps[step], meta, step, src


def find_tokenizer(path: str | Path) -> Path:
    """tokenizer.pkl for a base dir, a `*_checkpoints` dir or a tag dir: in `<root>/tokenizer/`
    or next to the checkpoint."""
    path = Path(path).expanduser()
    # Not nanochat's default base dir: a tokenizer from elsewhere would load silently.
    for place in (path, path / "tokenizer", path.parent / "tokenizer", path.parent.parent / "tokenizer"):
        if (place / "tokenizer.pkl").is_file():
            return place / "tokenizer.pkl"
    raise ModelLoadError(f"{path}: no tokenizer.pkl (looked in <root>/tokenizer/ and next to the checkpoint)")


# ---------------------------------------------------------------------------------------------
# Reading them
# ---------------------------------------------------------------------------------------------

def _read_meta(meta_file: Path) -> dict:
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {meta_file}: {' '.join(str(e).split())}") from None
    cfg = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{meta_file}: no model_config")
    missing = [k for k in REQUIRED_FIELDS if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    if missing:
        raise ModelLoadError(f"{meta_file}: model_config lacks {', '.join(missing)} (or not a positive integer)")
    return meta


def _read_state(model_file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, objects weights_only refuses, ...
        raise ModelLoadError(f"{model_file}: cannot load ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ModelLoadError(f"{model_file}: not a state dict of tensors")
    # torch.compile wraps the model; its state-dict keys carry the wrapper's attribute name.
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


def detect_era(state: dict[str, torch.Tensor]) -> str:
    if "smear_gate.weight" in state:
        return "F"
    if any(k.startswith("value_embeds.") for k in state):
        gates = [v for k, v in state.items() if k.endswith(".attn.ve_gate.weight")]
        channels = {g.shape[-1] for g in gates}
        if channels == {12}:
            return "E"
        if channels == {32}:
            return "C/D"
        raise ModelLoadError(f"unknown tensor layout: value embeddings with gate input widths {sorted(channels)} "
                             f"(known: 32 for eras C/D, 12 for E and F)")
    return "B" if "resid_lambdas" in state else "A"


def layer_windows(n_layer: int, sequence_len: int, pattern: str | None) -> list[int]:
    """Keys each layer's query sees, in our convention (causal_mask: the last `window` keys).
    nanochat's window w means keys p-w..p, i.e. w + 1 keys, hence the +1. The pattern tiles
    over the layers and the last layer is always long."""
    long = sequence_len
    short = math.ceil(sequence_len / 4 / 128) * 128
    pattern = pattern or "L"
    if not isinstance(pattern, str) or set(pattern := pattern.upper()) - {"S", "L"}:
        raise ModelLoadError(f"window_pattern {pattern!r} must be made of S and L")
    kinds = [pattern[i % len(pattern)] for i in range(n_layer)]
    kinds[-1] = "L"
    return [(short if k == "S" else long) + 1 for k in kinds]


def build_config(cfg: dict, state: dict[str, torch.Tensor], era_name: str,
                 overrides: dict | None = None) -> ModelConfig:
    era = ERAS[era_name]
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(OVERRIDES)
    if unknown:
        raise InvalidRequestError(f"unknown nanochat override(s) {sorted(unknown)}; known: {', '.join(OVERRIDES)}")
    n_layer, n_head, n_embd, seq_len = cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["sequence_len"]
    n_kv_head = check_int(cfg.get("n_kv_head") or n_head, "model_config.n_kv_head")
    # Before anything loops over the layers (fewer than the weights hold: the model names the extra ones when it takes them).
    layers = {int(m.group(1)) for k in state if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if n_layer > len(layers):
        raise ModelLoadError(f"model_config.n_layer {n_layer} is more than the {len(layers)} layers of weights "
                             "in the file")
    if n_embd % n_head or n_head % n_kv_head:
        raise ModelLoadError(f"model_config: n_embd {n_embd}, n_head {n_head}, n_kv_head {n_kv_head} do not divide")
    for key in ("rope_theta", "qk_scale"):
        value = overrides.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidRequestError(f"override {key} must be a positive number, got {value!r}")
    softcap = overrides.get("softcap", era.softcap)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0):
        raise InvalidRequestError(f"override softcap must be a positive number, or None/0 for no cap, got {softcap!r}")
    max_pos = overrides.get("max_position_embeddings", seq_len)
    if not isinstance(max_pos, int) or not 0 < max_pos <= 10 * seq_len:
        raise InvalidRequestError(f"max_position_embeddings must be in [1, {10 * seq_len}] (10x sequence_len, "
                                  f"nanochat's rotary table), got {max_pos!r}")
    pos_field = "max_position_embeddings" if "max_position_embeddings" in overrides else "model_config.sequence_len"
    check_int(max_pos, pos_field)
    wte = state.get("transformer.wte.weight")
    if wte is None or wte.dim() != 2 or wte.shape[0] < cfg["vocab_size"]:
        raise ModelLoadError("unknown tensor layout: transformer.wte.weight missing or smaller than vocab_size")

    extra: dict[str, Any] = {
        "era": era_name,
        "qk_scale": float(overrides.get("qk_scale", era.qk_scale)),
        "softcap": float(softcap) if softcap else None,
        "padded_vocab": wte.shape[0],
        "lambdas": era.lambdas,
        "sequence_len": seq_len,
    }
    if era.ve_gate_scale is not None:
        layers = sorted({int(m.group(1)) for k in state if (m := re.fullmatch(r"value_embeds\.(\d+)\.weight", k))})
        gate = state.get(f"transformer.h.{layers[0]}.attn.ve_gate.weight") if layers else None
        if gate is None:
            raise ModelLoadError("unknown tensor layout: value embeddings without transformer.h.<i>.attn.ve_gate")
        extra.update(ve_layers=layers, ve_gate_channels=gate.shape[1], ve_gate_scale=era.ve_gate_scale)
    if era.smear_backout:
        extra.update(smear_channels=state["smear_gate.weight"].shape[-1], backout_layer=n_layer // 2)
    # A checkpoint of a windowed era without the field: GPTConfig's default fills it in nanochat.
    pattern = (cfg.get("window_pattern") or "SSSL") if era.windows else "L"
    extra["window_pattern"] = pattern
    return ModelConfig(
        architecture="nanochat",
        vocab_size=cfg["vocab_size"],
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        num_layers=n_layer,
        num_heads=n_head,
        num_kv_heads=n_kv_head,
        head_dim=n_embd // n_head,
        rope_theta=float(overrides.get("rope_theta", era.rope_theta)),
        rms_norm_eps=torch.finfo(torch.float32).eps,  # informative: F.rms_norm's default for fp32
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        layer_windows=layer_windows(n_layer, seq_len, pattern),
        extra=extra,
    )


def load_nanochat(path: str | Path, dtype: torch.dtype = torch.float32, step: int | None = None,
                  tag: str | None = None, overrides: dict | None = None, source: str | None = None,
                  ) -> tuple[ModelConfig, dict[str, torch.Tensor], NanochatTokenizer, dict]:
    """Config, state dict (nanochat's keys, linear weights and embeddings in `dtype`, the
    scalars in fp32), tokenizer and a description of what was loaded (era, source, tag, step).

    overrides: rope_theta, qk_scale, softcap (None or 0: no cap), max_position_embeddings
    (default sequence_len; up to 10x, attending past sequence_len through the sliding windows)."""
    path = Path(path).expanduser()
    model_file, meta_file, step, src = find_checkpoint(path, step=step, tag=tag, source=source)
    tokenizer = NanochatTokenizer.from_pickle(find_tokenizer(model_file.parent))
    meta = _read_meta(meta_file)
    cfg = meta["model_config"]
    state = _read_state(model_file)
    era = detect_era(state)
    config = build_config(cfg, state, era, overrides)
    if tokenizer.vocab_size != config.vocab_size:
        raise ModelLoadError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}")

    out = {}
    for key, t in state.items():
        if key in SCALARS:  # stored as [] or [1]; the model keeps [1]
            out[key] = t.float().reshape(-1)  # the model checks the count
        else:
            out[key] = t.to(dtype)  # cast once here, not per call
    info = {
        "era": era,
        "source": src,
        "tag": model_file.parent.name,
        "step": step,
        "model_file": str(model_file),
        "meta_file": str(meta_file),
        "rope_theta": config.rope_theta,
        "qk_scale": config.extra["qk_scale"],
        "softcap": config.extra["softcap"],
        "max_position_embeddings": config.max_position_embeddings,
        "overrides": dict(overrides or {}),
    }
    if era == "C/D":
        info["note"] = "eras C and D look alike; softcap 15 (era C) is assumed, pass softcap=20 for era D"
    config.extra.update(source=src, tag=info["tag"], step=step)
    return config, out, tokenizer, info
