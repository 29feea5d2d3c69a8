"""The Llama module's decoder layers handed to the compiled decoder stack
(kernels/decoder_stack.py) when everything they hold can run there: a family whose registry
entry says `decoder_stack` (the builder sets `use_decoder_stack` from it), layers whose
features (LlamaForCausalLM.layer_features) are all in STACK_FEATURES (an allow-list: what
the stack computes; a feature it does not name, such as OLMo 2's norms over all heads or a
family's own layer class, keeps the modules, so none is computed silently wrong), every
projection in GGUF blocks with a kernel or fp32 in the packed GEMM's panels (an fp32 model,
an F32 file: the same GEMM the modules' PackedLinear calls, so the same bits), an attention
backend that declares `fused_stack` (an allow-list: the CPU paged-attention backend, whose
kernel and metadata the stack shares), fp32 activations.
Otherwise the modules run one by one, computing the same bits.

One stack per KV cache: it holds the cache's per-layer tensors and each layer's KV group."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend
from ..kernels import decoder_stack
from ..kernels.cpu_linear import PackedLinear
from ..kernels.decoder_stack import PACKED_F32, ROPE_GLOBAL, ROPE_LOCAL, ROPE_NONE, DecoderStack, LayerWeights, LinearWeights
from ..kernels.quant_linear import QuantLinear
from .batch import ForwardBatch


def _linear(module: nn.Module) -> LinearWeights | None:
    if isinstance(module, PackedLinear):  # fp32 weights (an fp32 model's, an F32 file's) in the packed GEMM's panels
        w = module.packed()
        return LinearWeights([(PACKED_F32, w, False)], module.bias) if w.dtype == torch.float32 else None
    if not isinstance(module, QuantLinear):
        return None
    return LinearWeights([(p.qtype, getattr(module, f"part{i}"), p.repacked) for i, p in enumerate(module.parts)],
                         module.bias)


# What the compiled stack computes (kernels/csrc/decoder_stack.cpp): RMSNorm layers, pre-norm,
# sandwiched (Gemma: the attention's and the MLP's outputs normed too) or post-norm (OLMo 2: only
# the outputs normed), rotary from the model's tables (LongRoPE's too; Gemma's windowed layers
# from their own local tables) on the whole of each head or on its first part, or none in a NoPE
# layer, q/k RMSNorm per head or over all heads, biased q/k/v, per-layer windows and attention
# soft-caps, the SiLU- or GELU(tanh)-gated MLP, or routed experts (kernels/routed_experts.py; not
# Qwen2-MoE's shared expert).
STACK_FEATURES = frozenset({"experts", "norm_pre", "norm_sandwich", "norm_post", "rms_norm", "mlp_silu", "mlp_gelu_tanh",
                            "qk_norm", "qk_norm_over_heads", "attention_bias", "window", "attention_softcap",
                            "nope_layers", "partial_rotary", "local_rotary_base"})


def unsupported_features(model: nn.Module) -> frozenset[str]:
    """The model's layer features the compiled stack does not compute (empty: it may run them)."""
    return model.layer_features() - STACK_FEATURES


def _build(model: nn.Module, attention: AttentionBackend) -> DecoderStack | None:
    config = model.config
    if unsupported_features(model):
        return None
    sandwich, post = config.norm_layout == "sandwich", config.norm_layout == "post"
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        moe = None
        if hasattr(mlp, "compiled"):  # a routed-experts block (models/moe.py): its compiled layer, if any
            moe = mlp.compiled()
            if moe is None or mlp.shared_expert is not None:
                return None
            linears = [_linear(attn.qkv_proj), _linear(attn.o_proj), LinearWeights([]), LinearWeights([])]
        else:
            linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears):
            return None
        p = attention.params[i]
        if config.rope_layers is not None and not config.rope_layers[i]:
            rope = ROPE_NONE
        else:  # Gemma's windowed layers turn by their own tables
            rope = ROPE_LOCAL if getattr(layer, "sliding", False) else ROPE_GLOBAL
        before_mlp = None if post else layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        layers.append(LayerWeights(
            None if post else layer.input_layernorm.weight.detach(),
            None if post else before_mlp.weight.detach(), *linears,
            *attention.cache.layer(i), attention.cache.group_of(i), p.window, p.scale, p.softcap,
            attn.q_norm.weight.detach() if attn.q_norm is not None else None,
            attn.k_norm.weight.detach() if attn.k_norm is not None else None, rope,
            layer.post_attention_layernorm.weight.detach() if sandwich or post else None,
            layer.post_feedforward_layernorm.weight.detach() if sandwich or post else None,
            "silu" if moe is not None else mlp.act, post_norm_layout=post, qk_norm_whole=config.qk_norm_over_heads,
            moe=moe))
    if not decoder_stack.supported(layers):
        return None
    return DecoderStack(layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                        config.intermediate_size, config.rms_norm_eps, config.rotary_dims())


def stack_for(model: nn.Module, batch: ForwardBatch) -> DecoderStack | None:
    """The compiled stack for this batch's cache, built on first use, or None where the
    layer modules must run."""
    attention = batch.attention
    if not (isinstance(attention, AttentionBackend) and attention.fused_stack and model.use_decoder_stack
            and model.model.norm.weight.device.type == "cpu"):
        return None
    cached = model.__dict__.get("_decoder_stack")
    if cached is None or cached[0] is not attention.cache:
        cached = (attention.cache, _build(model, attention))
        model.__dict__["_decoder_stack"] = cached
    return cached[1]


def run(stack: DecoderStack, x, cos, sin, batch: ForwardBatch, local=None):
    """local: the windowed layers' own (cos, sin), where the model has them (Gemma)."""
    meta = batch.attn_metadata
    assert not meta.prefills  # a fused_stack backend makes every row a one-row query
    return stack.run(x, cos, sin, meta.slot_mapping, meta.decode_rows, meta.decode_tables,
                     meta.decode_ctx.view(-1), meta.decode_max_ctx, *(local or (None, None)))
