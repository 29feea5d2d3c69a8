"""Hugging Face model folders: config.json + (sharded) *.safetensors + tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import ModelConfig
from ..errors import ModelLoadError

# HF class name -> our architecture name; all are served by models/llama.py.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def hf_config(raw: dict) -> ModelConfig:
    names = raw.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {names or raw.get('model_type')!r}; "
                             f"supported: {', '.join(ARCHITECTURES)}")
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported")
    heads = raw["num_attention_heads"]
    # transformers 5 keeps rope facts in rope_parameters; older files use rope_theta + rope_scaling.
    rope = dict(raw.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    window = raw.get("sliding_window") if arch == "mistral" or raw.get("use_sliding_window") else None
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        sliding_window=window,
    )


def load_hf_folder(path: Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from None
    try:
        config = hf_config(raw)
    except KeyError as e:
        raise ModelLoadError(f"{config_file}: missing field {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
    # Some exports store "lm_head" only; a tied model may also omit it.
    state = {k: v.to(dtype) for k, v in state.items()}
    if "lm_head.weight" not in state:
        config.tie_word_embeddings = True
    return config, state
