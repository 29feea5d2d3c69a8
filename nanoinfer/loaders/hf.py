"""Hugging Face model folders: config.json + (sharded) *.safetensors + tokenizer files."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .. import registry
from ..config import ModelConfig, MoeSpec, check_int, check_layer_count, check_number
from ..errors import ModelLoadError
from ..registry import Architecture

# A multimodal checkpoint's language model under its own prefixes (the original files, then
# transformers 5's), renamed to a text model's; its vision tower and projector are not read.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\.")
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.")


def _architecture(raw: dict) -> Architecture:
    names = raw.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ModelLoadError(f"architectures must be a list of class names, got {names!r:.60}")
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"model_type must be a string, got {model_type!r:.60}")
    return registry.for_hf(names, model_type)


def _dict(raw: dict, key: str) -> dict | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise ModelLoadError(f"{key} must be an object or null, got {value!r:.40}")
    return value


def hf_config(raw: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json; a missing or implausible field is a ModelLoadError
    that names it."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"config.json must hold a JSON object, not {type(raw).__name__}")
    arch = _architecture(raw)
    if isinstance(raw.get("text_config"), dict):  # a multimodal checkpoint (Gemma 3 4B+): its language model
        raw = {**raw["text_config"], "architectures": raw.get("architectures"),
               **({"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {})}
    raw = {**arch.hf_defaults, **raw}
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported")

    def size(key: str, default: int | None = None) -> int:
        value = raw.get(key)
        if value is None:  # transformers treats null as absent too
            if default is None:
                raise ModelLoadError(f"missing field {key!r}")
            return default
        return check_int(value, key)

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = size("num_key_value_heads", heads)
    head_dim = size("head_dim", max(hidden // heads, 1))
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # transformers 5 keeps rope facts in rope_parameters; older files use rope_theta + rope_scaling.
    rope = dict(_dict(raw, "rope_parameters") or {})
    local_rope = None
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): full layers, sliding ones
        local_rope = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
        rope = dict(rope["full_attention"])
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rotary_dim = None
    if partial is not None and partial != 1:  # Phi-4-mini: rotary on the first 3/4 of each head
        rotary_dim = int(head_dim * check_number(partial, "partial_rotary_factor"))
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ModelLoadError(f"partial_rotary_factor={partial!r:.20} gives {rotary_dim} rotary dims of {head_dim}")
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    theta_local = (local_rope or {}).get("rope_theta", raw.get("rope_local_base_freq"))
    scaling = _dict(raw, "rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in ("su", "longrope"):  # Phi-3 128k, Phi-3.5, Phi-4-mini ("su" is LongRoPE's old name)
        scaling = _longrope(scaling, raw, (rotary_dim or head_dim) // 2)
    elif kind not in (None, "default", "linear", "llama3"):
        raise ModelLoadError(f"rope scaling {kind!r:.30} is not supported (linear, llama3 and longrope are)")
    for key in _ROPE_NUMBERS:
        if scaling and key in scaling:
            check_number(scaling[key], f"rope_scaling.{key}")
    layers = size("num_hidden_layers")
    types = raw.get("layer_types")
    layer_windows = None
    if isinstance(types, list) and raw.get("sliding_window") is not None and arch.swa_pattern:
        if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ModelLoadError(f"layer_types must list {layers} of 'sliding_attention' / 'full_attention'")
        w = check_int(raw["sliding_window"], "sliding_window")
        layer_windows = [w if t == "sliding_attention" else None for t in types]
    window = raw.get("sliding_window") if arch.sliding_window or raw.get("use_sliding_window") or arch.swa_pattern \
        else None
    scalar = raw.get("query_pre_attn_scalar")
    return arch.adapt(ModelConfig(
        architecture=arch.name,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=check_number(theta, "rope_theta"),
        rms_norm_eps=check_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", allow_zero=True),
        max_position_embeddings=check_int(raw.get("max_position_embeddings", 2048), "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_scaling=scaling,
        sliding_window=None if window is None else check_int(window, "sliding_window"),
        rope_layers=_rope_layers(raw, layers),
        layer_windows=layer_windows,
        rotary_dim=rotary_dim,
        rope_theta_local=None if theta_local is None else check_number(theta_local, "rope_local_base_freq"),
        attn_scale=None if scalar is None else check_number(scalar, "query_pre_attn_scalar") ** -0.5,
        attn_softcap=_optional_number(raw, "attn_logit_softcapping"),
        final_softcap=_optional_number(raw, "final_logit_softcapping"),
        moe=_moe(raw, arch, layers) if arch.experts else None,
        # the file's fields, and the family's own keys as its registry entry names them, for its module
        extra={"hf_config": raw, **{k.name: k.from_hf(raw) for k in arch.config_keys}},
    ))


def _moe(raw: dict, arch: Architecture, layers: int) -> MoeSpec:
    """Qwen2-MoE / Qwen3-MoE (num_experts, moe_intermediate_size, a shared expert, dense layers by
    decoder_sparse_step and mlp_only_layers) and Mixtral (num_local_experts, intermediate_size)."""
    key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    if raw.get(key) is None:
        raise ModelLoadError(f"missing field {key!r}")
    experts = check_int(raw[key], key)
    top_k = check_int(raw.get("num_experts_per_tok"), "num_experts_per_tok", hi=experts)
    inter_key = "moe_intermediate_size" if raw.get("moe_intermediate_size") is not None else "intermediate_size"
    shared = raw.get("shared_expert_intermediate_size")
    step = check_int(raw.get("decoder_sparse_step", 1), "decoder_sparse_step")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelLoadError("mlp_only_layers must be a list of layer indices")
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    norm = arch.moe_norm_topk if arch.moe_norm_topk is not None else bool(raw.get("norm_topk_prob", False))
    return MoeSpec(experts, top_k, check_int(raw.get(inter_key), inter_key), norm,
                   check_int(shared, "shared_expert_intermediate_size") if shared else None,
                   None if all(sparse) else sparse)


def _longrope(scaling: dict, raw: dict, pairs: int) -> dict:
    """LongRoPE's facts in one dict: a factor per rotary pair for short and long contexts, the
    original context (config.json keeps it at the top level), and the attention factor if given."""
    out = {"rope_type": "longrope"}
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ModelLoadError(f"rope_scaling.{key} must list {pairs} numbers (one per rotary pair)")
        out[key] = [check_number(f, f"rope_scaling.{key}") for f in factors]
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("LongRoPE needs original_max_position_embeddings")
    out["original_max_position_embeddings"] = check_int(original, "original_max_position_embeddings")
    for key in ("factor", "attention_factor"):
        if scaling.get(key) is not None:
            out[key] = check_number(scaling[key], f"rope_scaling.{key}")
    return out


def _optional_number(raw: dict, key: str) -> float | None:
    return None if raw.get(key) is None else check_number(raw[key], key)


def _rope_layers(raw: dict, layers: int) -> list[bool] | None:
    """SmolLM3's NoPE layers: `no_rope_layers` (1 = rotary on, per layer), else every
    `no_rope_layer_interval`-th layer without; None where the config says neither."""
    listed = raw.get("no_rope_layers")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != layers or any(x not in (0, 1) for x in listed):
            raise ModelLoadError(f"no_rope_layers must be a list of {layers} zeros and ones")
        return [bool(x) for x in listed]
    interval = raw.get("no_rope_layer_interval")
    if interval is None:
        return None
    step = check_int(interval, "no_rope_layer_interval")
    return [(i + 1) % step != 0 for i in range(layers)]


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its text model's name; None for the vision parts."""
    if _NOT_TEXT.match(name):
        return None
    for prefix, new in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return new + name[len(prefix):]
    return name


def _check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """config.json's sizes against the weights present, before any of them is loaded or sized
    from the config (the rest of the layout is checked when the model takes the weights)."""
    check_layer_count(config.num_layers, {int(m.group(1)) for k in shapes if (m := _LAYER_WEIGHT.match(k))},
                      "num_hidden_layers")
    h, hd = config.hidden_size, config.head_dim
    expected = {
        "model.embed_tokens.weight": ((config.vocab_size, h), "vocab_size, hidden_size"),
        "model.layers.0.self_attn.q_proj.weight": ((config.num_heads * hd, h), "num_attention_heads, head_dim"),
        "model.layers.0.self_attn.k_proj.weight": ((config.num_kv_heads * hd, h), "num_key_value_heads, head_dim"),
        "model.layers.0.mlp.gate_proj.weight": ((config.intermediate_size, h), "intermediate_size"),
    }
    for name, (shape, fields) in expected.items():
        if name in shapes and shapes[name] != shape:
            raise ModelLoadError(f"{fields} in config.json imply {name} of shape {list(shape)}, "
                                 f"the weights have {list(shapes[name])}")
    for name, (shape, _) in registry.by_name(config.architecture).tensor_shapes(config).items():  # the family's own
        if name in shapes and shapes[name] != shape:
            raise ModelLoadError(f"config.json implies {name} of shape {list(shape)}, the weights have "
                                 f"{list(shapes[name])}")


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
    except ModelLoadError as e:
        raise ModelLoadError(f"{config_file}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:  # the headers only
        try:
            with safe_open(str(f), framework="pt") as sf:
                shapes.update((name, tuple(sf.get_slice(k).get_shape())) for k in sf.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
                              if (name := _text_name(k)) is not None)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
    try:
        _check_shapes(config, shapes)
    except ModelLoadError as e:
        raise ModelLoadError(f"{config_file}: {e}") from None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update((name, t) for k, t in load_file(str(f)).items() if (name := _text_name(k)) is not None)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
    # Some exports store "lm_head" only; a tied model may also omit it.
    state = {k: v.to(dtype) for k, v in state.items()}
    if "lm_head.weight" not in state:
        config.tie_word_embeddings = True
    return config, state
