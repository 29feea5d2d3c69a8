"""Test utility: write a transformers model as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py would for LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM. Tests use it to make GGUF files of tiny random models; nothing is downloaded.

What llama.cpp does and this mirrors:
- GGUF tensor names (token_embd, blk.N.attn_q, ..., output_norm, output); no output tensor when
  the embeddings are tied;
- for the llama and smollm3 architectures the q and k rows are permuted into llama.cpp's rope layout;
- Mistral is written as the llama architecture (plus, as an extension, its sliding window);
- 1-D tensors (norms, biases) stay F32, 2-D weights take `tensor_type`, falling back to F16 when
  a row does not split into whole quantization blocks;
- llama3 rope scaling becomes a `rope_freqs` tensor of per-frequency divisors, linear and yarn
  become rope.scaling.* keys;
- a tokenizer folder (tokenizer.json) becomes gpt2-style BPE metadata.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from nanoinfer.loaders import gguf as gguf_loader

_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3",
          "olmo2": "olmo2", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
          "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# llama.cpp's converter permutes q and k into its llama rope order for these (LlamaModel and
# its subclasses, SmolLM3Model among them); written here from that fact, not from the loader.
LLAMA_ROPE = {"llama", "smollm3"}

# The loader's name tables, inverted (HF -> GGUF). Sharing them is safe: the tests also read
# these exports back with transformers' own GGUF reader.
_GLOBAL_NAMES = {hf: gguf_name for gguf_name, hf in gguf_loader._GLOBAL_NAMES.items()}
_LAYER_NAMES = {hf: gguf_name for gguf_name, hf in gguf_loader._LAYER_NAMES.items()}
# HF's post_attention_layernorm is two different norms: Llama's before the MLP (llama.cpp's
# ffn_norm) and OLMo 2's on the attention's output (llama.cpp's post_attention_norm).
_LAYER_NAMES["post_attention_layernorm"] = "ffn_norm"
_POST_NORM_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                    "pre_feedforward_layernorm": "ffn_norm"}
POST_NORM = {"olmo2", "gemma2", "gemma3"}
# Gemma's RMSNorm multiplies by (1 + w); llama.cpp's converter stores 1 + w.
NORM_PLUS_ONE = {"gemma2", "gemma3"}
# transformers 5 holds each layer's experts stacked: gate_up [experts, 2 * ff, h], down [experts, h, ff];
# llama.cpp stores ffn_gate_exps and ffn_up_exps [experts, ff, h] and ffn_down_exps.
_STACKED_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.down_proj": ("ffn_down_exps",)}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight"""
    base, _, suffix = hf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    names = _POST_NORM_NAMES if arch in POST_NORM else _LAYER_NAMES
    if arch == "phi3":  # llama.cpp keeps Phi-3's fused gate/up as one ffn_up
        names = {**names, "mlp.gate_up_proj": "ffn_up"}
    parts = base.split(".", 3)  # model, layers, N, rest
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}.{suffix}"
    parts = hf_name.split(".", 3)
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in _STACKED_EXPERTS:  # (no .weight)
        return ",".join(f"blk.{parts[2]}.{n}.weight" for n in _STACKED_EXPERTS[parts[3]])
    raise ValueError(f"no GGUF name for {hf_name}")


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows (i, i + d/2) become neighbours."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in rope_parameters; older ones in rope_theta/rope_scaling."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the full layers' base
        params = dict(params["full_attention"])
    if getattr(cfg, "rope_scaling", None):
        params = {**cfg.rope_scaling, **params}
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling, computed as llama.cpp's converter does."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """(array for GGUFWriter.add_tensor, its type). Quantized data is uint8 rows of blocks."""
    if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16), qtype
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block_size:  # llama.cpp falls back to F16 for such tensors
        return w.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, vocab_size: int, pre: str | None) -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None
        if folder is None:  # a tokenizer object: look at what it saves
            tokenizer.save_pretrained(tmp)
            folder = Path(tmp)
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        tok = AutoTokenizer.from_pretrained(folder)
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers are exported, not {model.get('type')}")

    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    n = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:  # the model's vocabulary is larger than the tokenizer's
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    if pre is None:  # llama.cpp picks this by hashing the tokenizer's output; ByteLevel's regex is GPT-2's
        pt = data.get("pre_tokenizer") or {}
        pre = "gpt2" if pt.get("type") == "ByteLevel" and pt.get("use_regex", True) else "default"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token_id, add in [(tok.bos_token_id, writer.add_bos_token_id), (tok.eos_token_id, writer.add_eos_token_id),
                          (tok.unk_token_id, writer.add_unk_token_id), (tok.pad_token_id, writer.add_pad_token_id)]:
        if token_id is not None:
            add(token_id)
    config_file = folder / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if "add_bos_token" in tok_config:
        writer.add_add_bos_token(bool(tok_config["add_bos_token"]))
    if "add_eos_token" in tok_config:
        writer.add_add_eos_token(bool(tok_config["add_eos_token"]))
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def write_gguf_from_hf(
    model: Any,
    tokenizer: str | os.PathLike[str] | Any | None,
    path: str | os.PathLike[str],
    tensor_type: str = "F32",
    *,
    name: str | None = None,
    tokenizer_pre: str | None = None,
    vocab_only: bool = False,
    raw_tensors: dict[str, tuple[np.ndarray, int]] | None = None,
    arch: str | None = None,
    extra_fields: dict[str, float] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model` (a transformers *ForCausalLM) to `path` as GGUF; returns the path.

    tensor_type: "F32", "F16", "BF16" or a type gguf.quants can quantize ("Q8_0", "Q4_0", ...).
    tokenizer: a folder with tokenizer.json, a transformers tokenizer, or None for no vocab.
    name: general.name (default: the model type; "mistral" in it marks a Mistral model).
    vocab_only: metadata without tensors, like llama.cpp's --vocab-only.
    raw_tensors: GGUF tensor name -> (uint8 blocks [rows, row_bytes], GGML type) written as
    given in place of the model's tensor (types gguf-py cannot quantise, such as K-quants).
    arch, extra_fields, extra_tensors: a family of its own (tests/test_toy_family.py): the GGUF
    architecture name (default: the model type's), float32 "{arch}.KEY" fields and F32 tensors
    written besides the model's.
    """
    cfg = model.config
    if arch is None and cfg.model_type not in _ARCHS:
        raise ValueError(f"cannot export model type {cfg.model_type!r}")
    arch = arch or _ARCHS[cfg.model_type]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = _rope_parameters(cfg)

    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type("model")
    writer.add_name(name or cfg.model_type)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{tensor_type}", gguf.LlamaFileType.ALL_F32)
    writer.add_file_type(int(file_type))
    if cfg.model_type in ("mistral", "gemma2", "gemma3_text", "phi3") and getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)

    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:  # llama.cpp's expert keys; Mixtral's experts are its intermediate_size
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    kind = rope["rope_type"]
    if kind == "longrope" and not vocab_only:  # llama.cpp's phi3: factor tensors, original context, attention factor
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    elif kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3" and not vocab_only:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    elif kind != "default":
        raise ValueError(f"cannot export rope type {kind!r}")

    for hf_name, tensor in model.state_dict().items():
        if vocab_only or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        gguf_name = gguf_tensor_name(hf_name, arch)
        w = tensor.detach().to(torch.float32).cpu().numpy()
        if "," in gguf_name:  # stacked experts: gate and up are the two halves of each expert's rows
            for name, part in zip(gguf_name.split(","), np.split(w, len(gguf_name.split(",")), axis=1)):
                data, dtype = _encode(np.ascontiguousarray(part), qtype)
                writer.add_tensor(name, data, raw_dtype=dtype if data.dtype == np.uint8 else None)
            continue
        if gguf_name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")):
            # llama.cpp keeps routers in F32 when quantising; the shared gate is one row, stored 1-D
            writer.add_tensor(gguf_name, (w.reshape(-1) if w.shape[0] == 1 else w).astype(np.float32))
            continue
        if arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            w = w + 1.0
        if arch in LLAMA_ROPE and ".attn_q." in gguf_name:
            w = permute_qk(w, n_heads)
        elif arch in LLAMA_ROPE and ".attn_k." in gguf_name:
            w = permute_qk(w, n_kv)
        if raw_tensors and gguf_name in raw_tensors:
            data, dtype = raw_tensors[gguf_name]
            dtype = gguf.GGMLQuantizationType(dtype)
        else:
            data, dtype = _encode(w, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=dtype if data.dtype == np.uint8 else None)
    for key, value in (extra_fields or {}).items():
        writer.add_float32(f"{arch}.{key}", value)
    for gguf_name, w in ({} if vocab_only else extra_tensors or {}).items():
        writer.add_tensor(gguf_name, np.asarray(w, dtype=np.float32))

    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer, cfg.vocab_size, tokenizer_pre)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
