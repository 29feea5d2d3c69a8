"""A Llama-family decoder stack run as one compiled call (csrc/decoder_stack.cpp): every
layer's norms, projections (weights in their GGUF blocks, or fp32 in the packed GEMM's
panels: csrc/packed_gemm.cpp), rotary, KV-cache writes and paged
attention, in one OpenMP region. Each step is the same C++ function the layer modules call,
so the result is bit for bit theirs; what goes is the per-op cost of Python, tensor
allocation and starting threads, which at batch-1 decode was as large as the arithmetic.

This module knows weights and buffers only; nanoinfer/models/stack.py maps a model's layers
onto it."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_kernels, quant
from .routed_experts import RoutedExperts, RoutedExpertsStruct

_MAX_PARTS = 3  # kMaxParts in csrc/decoder_stack.cpp
_MAX_KV_GROUPS = 4  # kMaxKVGroups
_p, _i, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("qtype", _i), ("w", _p), ("n", _i), ("repacked", _i)]


class _Linear(ctypes.Structure):
    _fields_ = [("nparts", _i), ("part", _Part * _MAX_PARTS), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", _p), ("v_cache", _p), ("kv_group", _i), ("window", _i),
                ("scale", _f), ("softcap", _f), ("rope", _i), ("attn_out_norm", _p), ("mlp_out_norm", _p),
                ("act", _i), ("post_norm_layout", _i), ("qk_norm_whole", _i),
                ("moe", ctypes.POINTER(RoutedExpertsStruct))]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i), ("hidden", _i), ("H", _i), ("Hkv", _i), ("D", _i), ("inter", _i),
                ("block_size", _i), ("kv_format", _i), ("layers", ctypes.POINTER(_Layer)), ("eps", _f),
                ("rotary_dims", _i)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _i), ("path", _i), ("x", _p), ("residual", _p), ("cos", _p), ("sin", _p),
                ("slots", _p * _MAX_KV_GROUPS), ("tables", _p * _MAX_KV_GROUPS), ("rows", _p), ("ctx", _p),
                ("width", _i), ("max_ctx", _i), ("cos_local", _p), ("sin_local", _p)]


# LinearWeights' type of an fp32 weight in the packed GEMM's panels (cpu_kernels.pack_f32, as an
# fp32 model's PackedLinear holds it): csrc/decoder_stack.cpp's kPackedF32, below every GGML id.
PACKED_F32 = -1


@dataclass
class LinearWeights:
    # (GGML type, uint8 [n, row_bytes], repacked) side by side in the output, or one
    # (PACKED_F32, fp32 [n, K] packed, False)
    parts: list[tuple[int, torch.Tensor, bool]]
    bias: torch.Tensor | None = None


# csrc/team.h's KVFormat, by the cache tensor's dtype (uint8: q8_0 blocks, attention/kv_cache.py)
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}
ROPE_NONE, ROPE_GLOBAL, ROPE_LOCAL = 0, 1, 2  # csrc/decoder_stack.cpp: StackLayer.rope
ACTS = {"silu": 0, "gelu_tanh": 1}  # StackLayer.act


@dataclass
class LayerWeights:
    in_norm: torch.Tensor | None  # None: a post-norm layer (then attn_out_norm and mlp_out_norm)
    post_norm: torch.Tensor | None
    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights
    k_cache: torch.Tensor  # this layer's [blocks, block_size, Hkv, D'], fp32, bf16 or q8_0 (uint8)
    v_cache: torch.Tensor
    kv_group: int  # its KV group (attention/kv_cache.py): which of a step's slot and table sets it reads
    window: int | None
    scale: float
    softcap: float | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: int = ROPE_GLOBAL  # ROPE_NONE: a NoPE layer (q and k unrotated); ROPE_LOCAL: the local tables
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma): the attention's output normed,
    mlp_out_norm: torch.Tensor | None = None  # and the MLP's, before each joins the stream
    act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    post_norm_layout: bool = False  # OLMo 2: no norm before a branch, its output normed into the stream
    qk_norm_whole: bool = False  # q_norm [H * D] and k_norm [Hkv * D]: each normed over all its heads
    moe: RoutedExperts | None = None  # a mixture-of-experts layer's routed experts (gate_up and down then empty)


def supported(layers: list[LayerWeights]) -> bool:
    """Whether the compiled stack can run these layers (every linear a kernel type or packed
    fp32, or the routed experts' compiled layer in place of the MLP; fp32 norms, an fp32, bf16
    or q8_0 cache)."""
    if cpu_kernels.library() is None:
        return False
    for lw in layers:
        norms = [t for t in (lw.in_norm, lw.post_norm, lw.q_norm, lw.k_norm, lw.attn_out_norm, lw.mlp_out_norm)
                 if t is not None]
        if lw.post_norm_layout != (lw.in_norm is None) or (lw.post_norm_layout and lw.mlp_out_norm is None):
            return False
        if lw.act not in ACTS:
            return False
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
            return False
        if lw.k_cache.dtype not in KV_FORMATS or lw.v_cache.dtype != lw.k_cache.dtype:
            return False
        if not 0 <= lw.kv_group < _MAX_KV_GROUPS:
            return False
        if lw.moe is not None and (lw.gate_up.parts or lw.down.parts):
            return False
        for lin in (lw.qkv, lw.o) if lw.moe is not None else (lw.qkv, lw.o, lw.gate_up, lw.down):
            if not 1 <= len(lin.parts) <= _MAX_PARTS or not all(_part_supported(*p) for p in lin.parts):
                return False
            if lin.bias is not None and (lin.bias.dtype != torch.float32 or not lin.bias.is_contiguous()):
                return False
    return True


def _part_supported(qtype: int, w: torch.Tensor, repacked: bool) -> bool:
    if qtype == PACKED_F32:
        return w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous() and not repacked
    return quant.supported(qtype) and w.dtype == torch.uint8


def _linear(lin: LinearWeights) -> _Linear:
    out = _Linear(nparts=len(lin.parts), bias=lin.bias.data_ptr() if lin.bias is not None else None)
    for i, (qtype, w, repacked) in enumerate(lin.parts):
        out.part[i] = _Part(qtype, w.data_ptr(), w.shape[0], int(repacked))
    return out


class DecoderStack:
    """The layers' weights and caches, fixed at construction (the tensors must outlive it)."""

    def __init__(self, layers: list[LayerWeights], hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, rotary_dims: int | None = None):
        self.layers = layers  # keeps every tensor alive
        self.hidden, self.head_dim = hidden, head_dim
        self.rotary_dims = rotary_dims or head_dim  # rotary on each head's first rotary_dims values
        table = (_Layer * len(layers))()
        for i, lw in enumerate(layers):
            table[i] = _Layer(
                lw.in_norm.data_ptr() if lw.in_norm is not None else None,
                lw.post_norm.data_ptr() if lw.post_norm is not None else None,
                lw.q_norm.data_ptr() if lw.q_norm is not None else None,
                lw.k_norm.data_ptr() if lw.k_norm is not None else None,
                _linear(lw.qkv), _linear(lw.o), _linear(lw.gate_up), _linear(lw.down),
                lw.k_cache.data_ptr(), lw.v_cache.data_ptr(), lw.kv_group, lw.window or 0, lw.scale, lw.softcap or 0.0,
                lw.rope, lw.attn_out_norm.data_ptr() if lw.attn_out_norm is not None else None,
                lw.mlp_out_norm.data_ptr() if lw.mlp_out_norm is not None else None, ACTS[lw.act],
                int(lw.post_norm_layout), int(lw.qk_norm_whole),
                ctypes.pointer(lw.moe.struct) if lw.moe is not None else None)
        self._table = table
        self._model = _Model(len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate,
                             layers[0].k_cache.shape[1], KV_FORMATS[layers[0].k_cache.dtype],
                             ctypes.cast(table, ctypes.POINTER(_Layer)), eps, self.rotary_dims)
        self._model_ref = ctypes.byref(self._model)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: list[torch.Tensor],
            rows: torch.Tensor, tables: list[torch.Tensor], ctx: torch.Tensor, max_ctx: int,
            cos_local: torch.Tensor | None = None, sin_local: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the embeddings [T, hidden] fp32; cos, sin [T, 1, rotary_dims / 2] fp32; then the
        paged attention metadata of T one-row queries (per KV group the step's slots and each
        row's block table; each row's context and the largest context), as the CPU attention
        backend prepares it.
        Returns the last layer's output and the residual stream, as the layer modules' loop does."""
        T = x.shape[0]
        x = x.contiguous().clone()  # the call writes its output over its input
        residual = torch.empty_like(x)
        cos, sin = cos.contiguous(), sin.contiguous()
        assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.shape[1] == self.hidden
        assert cos.numel() == sin.numel() == T * (self.rotary_dims // 2)
        if any(lw.rope == ROPE_LOCAL for lw in self.layers):
            assert cos_local is not None and sin_local is not None, "layers on the local rotary need its tables"
            cos_local, sin_local = cos_local.contiguous(), sin_local.contiguous()
            assert cos_local.dtype == sin_local.dtype == torch.float32 and cos_local.shape == cos.shape == sin_local.shape
        assert len(slots) == len(tables) <= _MAX_KV_GROUPS and max(lw.kv_group for lw in self.layers) < len(slots)
        for t in (*slots, rows, *tables, ctx):
            assert t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == T
        assert all(t.shape[1] == tables[0].shape[1] for t in tables)
        step = _Step(T, quant.current_path(), x.data_ptr(), residual.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     (_p * _MAX_KV_GROUPS)(*(t.data_ptr() for t in slots)),
                     (_p * _MAX_KV_GROUPS)(*(t.data_ptr() for t in tables)),
                     rows.data_ptr(), ctx.data_ptr(), tables[0].shape[1], max_ctx,
                     cos_local.data_ptr() if cos_local is not None else None,
                     sin_local.data_ptr() if sin_local is not None else None)
        rc = cpu_kernels.library().decoder_stack(self._model_ref, ctypes.byref(step))
        if rc == 1:
            raise ValueError("decoder stack: the layers' projection shapes do not fit the model's dimensions")
        if rc:
            raise RuntimeError(f"decoder stack: quant_linear failed ({quant.error_message(rc)})")
        return x, residual
