"""Read GGUF files (llama.cpp's model format) into a ModelConfig and a Hugging Face style state dict.

The header is parsed here with `struct` instead of `gguf.GGUFReader`: the reader builds a numpy
view per metadata item, which takes seconds for a 50k-token vocabulary. Tensor data is
memory-mapped and dequantized with `gguf.quants.dequantize`, so every type gguf-py knows works.

GGUF layout (little-endian): magic "GGUF", uint32 version, uint64 tensor count, uint64 KV count,
the KV pairs, one info record per tensor (name, dims innermost first, type, offset), padding
to `general.alignment`, then the tensor data.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .. import registry
from ..config import MAX_SIZE, ModelConfig, MoeSpec, check_int, check_layer_count, check_number
from ..errors import ModelLoadError
from ..tensors import QuantizedTensor

__all__ = ["read_gguf_metadata", "gguf_config", "load_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRUCTS = {vtype: struct.Struct("<" + fmt) for vtype, fmt in _SCALAR_FORMATS.items()}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9

# GGUF tensor name -> HF name (without the .weight/.bias suffix).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # fused (phi3)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # Llama's norm before the MLP, which HF names so
    "post_attention_norm": "post_attention_layernorm",  # a norm on the attention's output (OLMo 2)
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Every expert of a layer in one 3-D tensor [experts, rows, columns]; split into the experts'
# own linears (model.layers.N.mlp.experts.E.gate_proj, ...).
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no weights of their own: rope_freqs holds llama3 rope factors and
# rope_factors_long/short LongRoPE's (read into the config), attn_rot_embd is a leftover of old
# conversions.
_NOT_WEIGHTS = re.compile(r"rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd\.weight")

# Dequantize about this many values per gguf-py call (see _dequantize).
_VALUES_PER_ROW = 16384
# Arrays of arrays deeper than this are not metadata any model has (and recursion has a limit).
_MAX_ARRAY_DEPTH = 16
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Corrupt(Exception):
    """The header points past the end of the file or holds an impossible value."""


@dataclass
class _TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy / HF order: outermost first (the file stores the reverse)
    offset: int  # absolute position of the data in the file
    nbytes: int


@dataclass
class _GGUFFile:
    meta: dict[str, Any]
    tensors: list[_TensorInfo]
    buf: mmap.mmap


class _Cursor:
    """Sequential reader over the mapped file with bounds checks."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Corrupt(f"a header item at byte {start} runs past the end of the file")
        self.pos = start + n
        return start

    def scalar(self, vtype: int) -> Any:
        st = _STRUCTS[vtype]
        return st.unpack_from(self.buf, self.take(st.size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth + 1)
        if vtype not in _SCALAR_FORMATS:
            raise _Corrupt(f"unknown metadata value type {vtype}")
        value = self.scalar(vtype)
        if vtype == _FLOAT32:
            # Shortest decimal that round-trips the float32 (1e-05 rather than 9.999999747378752e-06).
            value = float(str(np.float32(value)))
        return value

    def array(self, depth: int = 1) -> list[Any]:
        if depth > _MAX_ARRAY_DEPTH:
            raise _Corrupt(f"metadata arrays nested deeper than {_MAX_ARRAY_DEPTH} levels")
        vtype, count = self.scalar(4), self.scalar(10)
        if vtype in _NUMPY_TYPES:  # numeric arrays in one go (token types, scores)
            dtype = np.dtype(_NUMPY_TYPES[vtype])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        # A string takes at least its 8-byte length, an array its 12-byte header.
        if count * (8 if vtype == _STRING else 12) > len(self.buf) - self.pos:
            raise _Corrupt(f"array of {count} items cannot fit in the file")
        if vtype == _STRING:
            return self.strings(count)
        return [self.value(vtype, depth) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop (a vocabulary is ~10^5 of them: the header's bulk)."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _STRUCTS[10].unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise _Corrupt(f"a header item at byte {pos} runs past the end of the file")
            n = length(buf, pos)[0]
            pos += 8
            if n > end - pos:
                raise _Corrupt(f"a header item at byte {pos} runs past the end of the file")
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def _open(path: str | os.PathLike[str], with_tensors: bool) -> _GGUFFile:
    """Map the file and parse its header; every failure becomes a one-line ModelLoadError."""
    p = Path(path)
    if p.is_dir():
        raise ModelLoadError(f"expected a GGUF file, got a directory: {p}")
    if not p.is_file():
        raise ModelLoadError(f"GGUF file not found: {p}")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ModelLoadError(f"not a GGUF file (bad magic): {p}")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {p}: {exc.strerror or exc}") from None
    try:
        cur = _Cursor(buf)
        cur.take(4)
        version = cur.scalar(4)
        if version not in (2, 3):
            hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
            raise ModelLoadError(f"unsupported GGUF version {version}{hint}: {p}")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar(4))
        tensors: list[_TensorInfo] = []
        if with_tensors:
            tensors = _parse_tensor_infos(cur, n_tensors, meta, size)
    except ModelLoadError:
        raise
    except (_Corrupt, struct.error, ValueError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"corrupt or truncated GGUF file {p}: {exc}") from None
    return _GGUFFile(meta, tensors, buf)


def _parse_tensor_infos(cur: _Cursor, count: int, meta: dict[str, Any], size: int) -> list[_TensorInfo]:
    if count > size:
        raise _Corrupt(f"tensor count {count} cannot fit in the file")
    raw = []
    for _ in range(count):
        name = cur.string()
        n_dims = cur.scalar(4)
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = [cur.scalar(10) for _ in range(n_dims)]
        type_id, offset = cur.scalar(4), cur.scalar(10)
        raw.append((name, dims, type_id, offset))
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"bad general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    expected = 0  # llama.cpp's layout rule: each tensor starts where the previous one ends, padded
    for name, dims, type_id, offset in raw:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise _Corrupt(f"tensor {name!r} has unknown type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block_size:
            raise _Corrupt(f"tensor {name!r}: row of {dims[0]} is not a multiple of the {qtype.name} block")
        nbytes = math.prod(dims) // block_size * type_size
        # The contiguity rule is what catches a tensor whose type or shape was altered: its size
        # changes, so the next tensor no longer starts where this one ends.
        if offset != expected:
            raise _Corrupt(f"tensor {name!r} has offset {offset}, expected {expected} (the previous tensor's end "
                           f"padded to general.alignment {alignment}): tensors overlap, leave gaps or changed size")
        start = data_start + offset
        if start + nbytes > size:
            raise _Corrupt(f"tensor {name!r} ends past the end of the file (truncated?)")
        expected = offset + -(-nbytes // alignment) * alignment
        tensors.append(_TensorInfo(name, qtype, tuple(reversed(dims)), start, nbytes))
    # Writers end the file with the last tensor (and its padding); more bytes after it mean the
    # last tensor's declared size is short of what was written (a retyped or reshaped last tensor).
    if tensors and size - (data_start + expected) >= alignment:
        last = tensors[-1]
        raise _Corrupt(f"tensor {last.name!r} is the last, but {size - last.offset - last.nbytes} bytes follow its "
                       f"{last.nbytes} bytes of {last.qtype.name} data: its type or shape does not match the file")
    return tensors


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every KV field of a GGUF file as plain Python values (arrays as lists). Reads no tensor data,
    so it also works on vocab-only files."""
    return _open(path, with_tensors=False).meta


# ----------------------------------------------------------------------------- config


def _arch_key(meta: Mapping[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
    if isinstance(value, list):  # some converters write per-layer lists; we need them uniform
        if not value or any(v != value[0] for v in value):
            raise ModelLoadError(f"GGUF metadata {arch}.{key} varies per layer ({value}); not supported")
        value = value[0]
    return value


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict | None:
    """HF rope_scaling dict from {arch}.rope.scaling.* (linear and yarn; llama3 lives in a tensor)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or factor is None or factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": check_number(factor, f"{arch}.rope.scaling.factor")}
    if kind == "linear":
        return scaling
    if kind == "yarn":
        extras = {
            "original_context_length": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast",
            "yarn_beta_slow": "beta_slow",
        }
        for gguf_key, hf_key in extras.items():
            if (value := meta.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
                scaling[hf_key] = check_number(value, f"{arch}.rope.scaling.{gguf_key}")
        return scaling
    raise ModelLoadError(f"unsupported rope scaling type {kind!r} in GGUF metadata")


def gguf_config(meta: Mapping[str, Any], tensor_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelConfig:
    """Model hyper-parameters from GGUF metadata.

    `tensor_shapes` (GGUF tensor name -> shape) settles the facts that GGUF keeps only in its tensor
    list: tied embeddings (no output.weight), q/k/v biases, q/k norms. Without it they are guessed
    from the architecture (untied; qwen2 has biases, qwen3 has q/k norms).
    """
    arch = meta.get("general.architecture")
    family = registry.for_gguf(arch)

    def size(key: str, default: Any = None) -> int:
        return check_int(_arch_key(meta, arch, key, default), f"{arch}.{key}")

    hidden = size("embedding_length")
    n_heads = size("attention.head_count")
    n_kv_heads = size("attention.head_count_kv", n_heads)
    head_dim = size("attention.key_length", max(hidden // n_heads, 1))
    if n_heads % n_kv_heads:
        raise ModelLoadError(f"{arch}.attention.head_count {n_heads} is not a multiple of "
                             f"{arch}.attention.head_count_kv {n_kv_heads}")
    num_layers = size("block_count")
    if tensor_shapes is not None:  # checked before anything loops over the layers
        check_layer_count(num_layers, {int(m.group(1)) for name in tensor_shapes
                                       if (m := _LAYER_TENSOR.fullmatch(name))}, f"{arch}.block_count")

    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        vocab = len(meta["tokenizer.ggml.tokens"])
    if vocab is None and tensor_shapes and "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][0]
    if vocab is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    vocab = check_int(vocab, f"{arch}.vocab_size")

    if tensor_shapes is None:  # the family's facts (the registry's adapter) fill these in
        tied, bias, qk_norm = False, False, False
    else:
        tied = "output.weight" not in tensor_shapes
        bias = "blk.0.attn_q.bias" in tensor_shapes
        qk_norm = "blk.0.attn_q_norm.weight" in tensor_shapes

    sliding_window = meta.get(f"{arch}.attention.sliding_window")
    family = _variant(family, meta, arch)
    moe = _moe_spec(meta, arch, family, num_layers, tensor_shapes) if family.experts else None

    # the file's "{arch}." fields, and the family's own keys as its registry entry names them, for its module
    extra = {"gguf_architecture": arch, "gguf_fields": {k: v for k, v in meta.items() if k.startswith(f"{arch}.")}}
    extra.update({key.name: key.from_gguf(meta, arch) for key in family.config_keys})
    rotary_dim = None
    if (rope_dim := meta.get(f"{arch}.rope.dimension_count")) is not None:
        extra["rope_dimension_count"] = check_int(rope_dim, f"{arch}.rope.dimension_count", hi=head_dim)
        if rope_dim != head_dim:  # partial rotary (Phi-4-mini): the first rope_dim dims of each head
            if rope_dim % 2:
                raise ModelLoadError(f"{arch}.rope.dimension_count {rope_dim} is odd")
            rotary_dim = rope_dim
    return family.adapt(ModelConfig(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=size("feed_forward_length", moe.intermediate_size if moe else None),
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_theta=check_number(meta.get(f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base"),
        rms_norm_eps=check_number(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
                                  f"{arch}.attention.layer_norm_rms_epsilon", allow_zero=True),
        max_position_embeddings=check_int(meta.get(f"{arch}.context_length", 2048), f"{arch}.context_length"),
        tie_word_embeddings=tied,
        attention_bias=bias,
        qk_norm=qk_norm,
        rope_scaling=_rope_scaling(meta, arch),
        sliding_window=check_int(sliding_window, f"{arch}.attention.sliding_window") if sliding_window else None,
        rope_theta_local=(check_number(local, f"{arch}.rope.freq_base_swa")
                          if (local := meta.get(f"{arch}.rope.freq_base_swa")) is not None else None),
        attn_softcap=(check_number(cap, f"{arch}.attn_logit_softcapping")
                      if (cap := meta.get(f"{arch}.attn_logit_softcapping")) else None),
        final_softcap=(check_number(cap, f"{arch}.final_logit_softcapping")
                       if (cap := meta.get(f"{arch}.final_logit_softcapping")) else None),
        rotary_dim=rotary_dim,
        moe=moe,
        extra=extra,
    ))


def _variant(family: registry.Architecture, meta: Mapping[str, Any], arch: str) -> registry.Architecture:
    """The family a file written under `family`'s GGUF name is (llama.cpp writes Mistral and Mixtral
    as "llama"): the first registered variant with experts exactly when the file has them and
    one of its marks; else `family`."""
    experts = bool(meta.get(f"{arch}.expert_count"))
    name = f"{meta.get('general.name', '')} {meta.get('general.basename', '')}".lower()
    return next((v for v in registry.ARCHITECTURES if v.gguf_variant_of == family.name and v.experts == experts
                 and (any(meta.get(f"{arch}.{k}") is not None for k in v.gguf_marks)
                      or any(word in name for word in v.gguf_name_marks))), family)


def _moe_spec(meta: Mapping[str, Any], arch: str, family: registry.Architecture, num_layers: int,
              tensor_shapes: Mapping[str, Sequence[int]] | None) -> MoeSpec:
    """llama.cpp's expert keys; a layer without a router (ffn_gate_inp) keeps a dense MLP."""
    def key(name: str, default: Any = None, hi: int = MAX_SIZE) -> int:
        return check_int(_arch_key(meta, arch, name, default), f"{arch}.{name}", hi=hi)

    experts = key("expert_count")
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    norm = meta.get(f"{arch}.expert_weights_norm")
    sparse = None
    if tensor_shapes is not None:
        sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes for i in range(num_layers)]
        sparse = None if all(sparse) else sparse
    return MoeSpec(experts, key("expert_used_count", hi=experts),
                   key("expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length")),
                   bool(norm) if norm is not None else family.gguf_moe_norm_topk,
                   check_int(shared, f"{arch}.expert_shared_feed_forward_length") if shared else None, sparse)


def _longrope_scaling(meta: Mapping[str, Any], arch: str, factors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """LongRoPE from llama.cpp's phi3 file: rope_factors_long/short (a divisor per rotary pair),
    the original context and the attention factor as keys."""
    pairs = cfg.rotary_dims() // 2
    if set(factors) != {"long", "short"} or any(f.size != pairs for f in factors.values()):
        raise ModelLoadError(f"rope_factors_long and rope_factors_short must each hold {pairs} values")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length (LongRoPE)")
    scaling = {"rope_type": "longrope", "short_factor": factors["short"].ravel().tolist(),
               "long_factor": factors["long"].ravel().tolist(),
               "original_max_position_embeddings": check_int(original, f"{arch}.rope.scaling.original_context_length")}
    if (attn := meta.get(f"{arch}.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = check_number(attn, f"{arch}.rope.scaling.attn_factor")
    return scaling


def _llama3_rope_scaling(rope_factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Recover HF's llama3 rope_scaling from the per-frequency divisors llama.cpp stores in rope_freqs.

    llama3 divides each inverse frequency by 1 (short wavelengths), by `factor` (long ones) or, in
    between, by r with 1/r = (1 - s)/factor + s, where s falls linearly in 1/wavelength from 1 at
    original/high_freq_factor to 0 at original/low_freq_factor. Only those two wavelengths matter,
    so low_freq_factor is fixed at 1 and the rest fitted from the in-between frequencies.
    """
    factors = rope_factors.astype(np.float64).ravel()
    factor = float(factors.max())
    if factor <= 1.0 or len(factors) != head_dim // 2:
        return None
    x = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)  # 1 / wavelength
    s = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    tol = 1e-6
    mid = (s > tol) & (s < 1 - tol)
    if mid.sum() >= 2:
        slope, icept = np.polyfit(x[mid], s[mid], 1)
        x_lo, x_hi = -icept / slope, (1 - icept) / slope
    else:  # too few samples to fit: put the edges between the samples on either side
        x_lo = x[s <= tol].max() if (s <= tol).any() else x.min()
        x_hi = x[s >= 1 - tol].min() if (s >= 1 - tol).any() else x.max()
    original = round(1.0 / x_lo)
    return {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(x_hi * original, 6),
        "original_max_position_embeddings": original,
    }


# ----------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, norm_layout: str = "pre", fused: bool = False,
             own: Mapping[str, str] | None = None) -> str | None:
    """The module's name for a GGUF tensor; `own`: the family's own tensors (GGUF name -> name)."""
    if own and gguf_name in own:
        return own[gguf_name]
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        # with norms on both sides (Gemma), ffn_norm is the one before the MLP, HF's pre_feedforward_layernorm
        name = "pre_feedforward_layernorm" if norm_layout == "sandwich" and m.group(2) == "ffn_norm" \
            else "mlp.gate_up_proj" if fused and m.group(2) == "ffn_up" else _LAYER_NAMES[m.group(2)]
        return f"model.layers.{m.group(1)}.{name}.{m.group(3)}"
    return None


def _dequantize(buf: mmap.mmap, info: _TensorInfo) -> np.ndarray:
    """float32 array of `info.shape`, never a view of the mapped file."""
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    n_blocks = info.nbytes // type_size
    raw = np.frombuffer(buf, np.uint8, info.nbytes, info.offset)
    # gguf-py works on groups of 16 rows; a call per small group is slow, one call over a whole
    # embedding is memory-bound. Blocks are independent, so regroup into rows of about
    # _VALUES_PER_ROW values (a divisor of the block count) - about 3x faster on the default model.
    per_row = max(1, min(n_blocks, _VALUES_PER_ROW // block_size))
    while n_blocks % per_row:
        per_row -= 1
    try:
        values = quants.dequantize(raw.reshape(-1, per_row * type_size), info.qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {info.name!r} has type {info.qtype.name}, which gguf-py cannot dequantize"
        ) from None
    if np.may_share_memory(values, raw):  # F32 comes back as a view of the file
        values = values.copy()
    return values.reshape(info.shape)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for its llama rope (pairs interleaved within each head),
    giving HF's rotate-half order. The converter did reshape(n, 2, d/2, ...).swapaxes(1, 2)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the file must hold: llama.cpp's common layout for the config, then the family's own."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, h)
    family = registry.by_name(cfg.architecture)
    fused = family.gguf_fused
    for i in range(cfg.num_layers):
        ff = cfg.intermediate_size
        if fused:  # phi3: q/k/v in one tensor, gate/up in ffn_up
            layer = {"attn_qkv.weight": (q + 2 * kv, h)}
        else:
            layer = {"attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h)}
        layer["attn_output.weight"] = (h, q)
        if cfg.sparse(i):
            moe = cfg.moe
            n, fe = moe.num_experts, moe.intermediate_size
            layer.update({"ffn_gate_inp.weight": (n, h), "ffn_gate_exps.weight": (n, fe, h),
                          "ffn_up_exps.weight": (n, fe, h), "ffn_down_exps.weight": (n, h, fe)})
            if fs := moe.shared_intermediate_size:
                layer.update({"ffn_gate_inp_shexp.weight": (h,), "ffn_gate_shexp.weight": (fs, h),
                              "ffn_up_shexp.weight": (fs, h), "ffn_down_shexp.weight": (h, fs)})
        elif fused:
            layer.update({"ffn_up.weight": (2 * ff, h), "ffn_down.weight": (h, ff)})
        else:
            layer.update({"ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h), "ffn_down.weight": (h, ff)})
        norms = {"pre": ("attn_norm", "ffn_norm"), "post": ("post_attention_norm", "post_ffw_norm"),
                 "sandwich": ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}[cfg.norm_layout]
        layer.update({f"{n}.weight": (h,) for n in norms})
        if cfg.attention_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            whole = cfg.qk_norm_over_heads
            layer.update({"attn_q_norm.weight": (q if whole else cfg.head_dim,),
                          "attn_k_norm.weight": (kv if whole else cfg.head_dim,)})
        shapes.update({f"blk.{i}.{k}": v for k, v in layer.items()})
    shapes.update({gguf: shape for shape, gguf in family.tensor_shapes(cfg).values() if gguf is not None})
    return shapes


def _shape(info: _TensorInfo) -> tuple[int, ...]:
    """A tensor's shape as checked: the shared expert's gate is one row, [1, h] or [h] by converter."""
    if info.name.endswith(".ffn_gate_inp_shexp.weight") and len(info.shape) == 2 and info.shape[0] == 1:
        return info.shape[1:]
    return info.shape


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype | None = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedTensor], dict[str, Any], Callable[[], None]]:
    """(config, state dict with HF names and shapes, GGUF metadata, release); llama q/k rows
    are put back in HF order. With a dtype every tensor is dequantized to it; with None ("as
    stored") matrices that are not F32 stay QuantizedTensors over the mapped file (no copy,
    nothing read until used) and vectors (norms, biases) become float32. release() drops the
    mapped file's pages from the process's resident memory once the model holds copies of
    what it read at load (the kernels' repacked weights): the map is read-only and shared, so
    a page still in use is read back from the page cache when next touched."""
    gf = _open(path, with_tensors=True)
    if not gf.tensors:
        raise ModelLoadError(f"{path} holds no tensors (a vocab-only GGUF?); it cannot be loaded as a model")
    shapes = {t.name: _shape(t) for t in gf.tensors}
    cfg = gguf_config(gf.meta, shapes)

    expected = _expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in shapes:
            raise ModelLoadError(f"GGUF file {path} lacks tensor {name}")
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"tensor {name} has shape {list(shapes[name])}, the metadata implies {list(shape)}")

    family = registry.by_name(cfg.architecture)
    own = {gguf: name for name, (_, gguf) in family.tensor_shapes(cfg).items() if gguf is not None}
    state: dict[str, torch.Tensor] = {}
    longrope: dict[str, np.ndarray] = {}
    for info in gf.tensors:
        if _NOT_WEIGHTS.fullmatch(info.name):
            if info.name == "rope_freqs.weight" and cfg.rope_scaling is None:
                factors = _dequantize(gf.buf, info)
                cfg.rope_scaling = _llama3_rope_scaling(factors, cfg.rope_theta, cfg.head_dim)
                cfg.extra["rope_freqs"] = factors.ravel().tolist()
            elif info.name.startswith("rope_factors_"):
                longrope[info.name.split("_")[2].split(".")[0]] = _dequantize(gf.buf, info)
            continue
        if m := _EXPERT_TENSOR.fullmatch(info.name):
            if info.name not in expected:
                raise ModelLoadError(f"unexpected tensor {info.name!r} in a {cfg.architecture} GGUF file")
            for e, t in enumerate(_experts(gf.buf, info, dtype)):
                state[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}_proj.weight"] = t
            continue
        hf_name = _hf_name(info.name, cfg.norm_layout, family.gguf_fused, own)
        if hf_name is None or info.name not in expected:
            raise ModelLoadError(f"unexpected tensor {info.name!r} in a {cfg.architecture} GGUF file")
        permute = family.gguf_llama_rope and info.name.endswith((".attn_q.weight", ".attn_k.weight"))
        if dtype is None and len(info.shape) == 2 and info.qtype != GGMLQuantizationType.F32:
            qt = _as_stored(gf.buf, info)
            if permute:  # whole rows move: exact in any block format
                heads = cfg.num_heads if ".attn_q." in info.name else cfg.num_kv_heads
                qt = qt.take_rows(torch.from_numpy(_unpermute(np.arange(info.shape[0]), heads)))
            state[hf_name] = qt
            continue
        w = _dequantize(gf.buf, info)
        if family.gguf_llama_rope:
            if info.name.endswith((".attn_q.weight", ".attn_q.bias")):
                w = _unpermute(w, cfg.num_heads)
            elif info.name.endswith((".attn_k.weight", ".attn_k.bias")):
                w = _unpermute(w, cfg.num_kv_heads)
        if info.name.endswith(".ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)
        state[hf_name] = torch.from_numpy(w).to(dtype or torch.float32)
    if longrope:
        cfg.rope_scaling = _longrope_scaling(gf.meta, cfg.extra["gguf_architecture"], longrope, cfg)
    return cfg, state, gf.meta, functools.partial(_release, gf.buf)


def _experts(buf: mmap.mmap, info: _TensorInfo, dtype: torch.dtype | None) -> list[torch.Tensor | QuantizedTensor]:
    """A [experts, rows, columns] tensor as one matrix per expert: views of the file's blocks
    (each expert's rows are contiguous) when kept as stored, else dequantised. With dtype None
    an F32 file's experts stay as stored too: the routed-experts layer reads them in place
    (a dense GEMM's packed copy of every expert would hold the experts twice during the load)."""
    n, rows, cols = info.shape
    if dtype is None:
        data = _stored_bytes(buf, info).view(n, rows, -1)
        each = info.nbytes // n
        return [QuantizedTensor(data[e], int(info.qtype), (rows, cols), info.qtype.name,
                                release=functools.partial(_release, buf, info.offset + e * each, each))
                for e in range(n)]
    w = torch.from_numpy(_dequantize(buf, info)).to(dtype or torch.float32)
    return list(w.unbind(0))


def _release(buf: mmap.mmap, offset: int = 0, nbytes: int | None = None) -> None:
    """Drop the mapped file's pages (all, or those of one tensor) from this process's memory;
    read again from the file if touched again, so a page shared with a neighbour is safe to drop."""
    if not hasattr(mmap, "MADV_DONTNEED") or buf.closed:
        return
    if nbytes is None:
        buf.madvise(mmap.MADV_DONTNEED)
        return
    start = offset - offset % mmap.PAGESIZE
    end = min(len(buf), offset + nbytes)
    if end > start:
        buf.madvise(mmap.MADV_DONTNEED, start, end - start)


def _stored_bytes(buf: mmap.mmap, info: _TensorInfo) -> torch.Tensor:
    """The tensor's bytes as a uint8 view of the mapped file."""
    with warnings.catch_warnings():  # the map is read-only; nothing ever writes through this view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)


def _as_stored(buf: mmap.mmap, info: _TensorInfo) -> QuantizedTensor:
    return QuantizedTensor(_stored_bytes(buf, info).view(info.shape[0], -1), int(info.qtype), info.shape,
                           info.qtype.name, release=functools.partial(_release, buf, info.offset, info.nbytes))


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """A QuantizedTensor as float32 (gguf-py's reference dequantisation)."""
    values = quants.dequantize(qt.data.numpy(), GGMLQuantizationType(qt.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(qt.shape)
