"""The Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), SmolLM2, SmolLM3
(no rotary on every 4th layer).

One module serves them all; the differences are flags on ModelConfig. Weights use
Hugging Face names and layouts, so a state dict from any loader drops in as is.

The forward takes one ForwardBatch: a flat run of tokens with their positions and an
attention backend that owns the KV cache; it never sees requests or scheduling.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels import layer_ops
from ..kernels.quant_linear import QuantEmbedding, QuantLinear
from . import stack as decoder_stack
from .batch import ForwardBatch
from .quantized import cat_rows, place_quantized
from .rotary import RotaryTable


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of the stream, the stream): the stream is residual + x, or x without one."""
        return layer_ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig, context: int | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotated dims, with the rope scalings that change them ("linear",
    "llama3", "longrope"). LongRoPE takes its long factors when the serving context (the
    engine's max_model_len; default the model's) is past the original one, its short factors
    otherwise: one choice per engine, as llama.cpp makes it from n_ctx, so a row's rotary never
    depends on what else runs (transformers switches per forward on the longest sequence)."""
    dim = config.rotary_dims()
    # fp32 throughout, as transformers computes it: parity is bit-level at long positions too.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "longrope":
        long = (context or config.max_position_embeddings) > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (factors * config.rope_theta ** exponents)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def rope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE scales cos and sin (so q.k) by sqrt(1 + ln(s) / ln(original)), s the context
    extension, in both its short and long modes; 1 for every other rotary."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # q, k and v in one matmul: one larger GEMM runs faster than three small ones
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_rope = config.rope_layers is None or config.rope_layers[layer]
        self.rotary_dim = config.rotary_dims()
        self.qk_norm_over_heads = config.qk_norm_over_heads
        if config.qk_norm:
            n = self.num_heads * self.head_dim if self.qk_norm_over_heads else self.head_dim
            n_k = self.num_kv_heads * self.head_dim if self.qk_norm_over_heads else self.head_dim
            self.q_norm = RMSNorm(n, config.rms_norm_eps)
            self.k_norm = RMSNorm(n_k, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        if self.qk_norm_over_heads:  # OLMo 2: each of q and k normed whole, then rotated
            q = self.q_norm(qkv[:, :H * D])[0].view(T, H, D)
            k = self.k_norm(qkv[:, H * D:(H + Hkv) * D])[0].view(T, Hkv, D)
            if self.use_rope:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        elif not self.use_rope:  # a NoPE layer (SmolLM3)
            q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            if self.q_norm is not None:
                q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        elif self.q_norm is not None:
            q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            q, k = self._rope(self.q_norm(q)[0], cos, sin), self._rope(self.k_norm(k)[0], cos, sin)
        else:  # q and k side by side: one rotation for both (half the ops)
            q, k = self._rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin).split((H, Hkv), dim=1)
        out = batch.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on each head's first rotary_dim dims (all of them but in Phi-4-mini's partial rotary)."""
        if self.rotary_dim == self.head_dim:
            return layer_ops.rope(x, cos, sin)
        return torch.cat((layer_ops.rope(x[..., :self.rotary_dim], cos, sin), x[..., self.rotary_dim:]), dim=-1)


class MLP(nn.Module):
    """The gated MLP: down(act(gate) * up), gate and up in one matmul. act: "silu" (Llama) or
    "gelu_tanh" (Gemma)."""

    def __init__(self, config: ModelConfig, act: str = "silu", intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(layer_ops.silu_mul(h) if self.act == "silu" else layer_ops.gelu_tanh_mul(h))


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names in, this module's fused qkv_proj / gate_up_proj out."""
    fused: dict[str, list] = {}
    out = {}
    for name, t in state.items():
        for parts, target in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            for i, part in enumerate(parts):
                if f".{part}." in name:
                    key = name.replace(f".{part}.", f".{target}.")
                    fused.setdefault(key, [None] * len(parts))[i] = t
                    break
            else:
                continue
            break
        else:
            out[name] = t
    for key, parts in fused.items():
        if any(p is None for p in parts):
            raise ValueError(f"incomplete projections for {key}")
        out[key] = cat_rows(parts)
    return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch: ForwardBatch):
        """x: the previous layer's output (the embeddings, with residual None, for the first);
        residual: the stream it adds to. Returns this layer's output and the stream, whose
        sum the next norm takes in one pass (vLLM's fused add + RMSNorm)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, batch), residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """Named `model` inside LlamaForCausalLM so that state-dict keys match HF's."""

    def __init__(self, config: ModelConfig, layer_class: type[nn.Module]):
        super().__init__()
        # _weight: no random init (the file's weights replace it; on the meta device torch's
        # normal_ would import torch._dynamo, a second of every load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Run the layers as one compiled call where they can (models/stack.py): the builder turns it
    # on for the families whose registry entry says decoder_stack (an allow-list, not an opt-out).
    use_decoder_stack = False
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.layer_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.context = config.max_position_embeddings
        self.rotary = RotaryTable(rope_inv_freq(config), config.max_position_embeddings)
        self.reset_rope()

    def layer_features(self) -> frozenset[str]:
        """What its layers compute, named for the compiled stack's capability check
        (models/stack.py: the stack runs a model only if it implements every one)."""
        c = self.config
        f = {f"norm_{c.norm_layout}", "rms_norm"}
        for layer in self.model.layers:
            # A family's own layer class computes what the stack does not know, unless it says that
            # its layers are this module's parts arranged as its norm layout names (stack_layer).
            if type(layer) is not DecoderLayer and not type(layer).__dict__.get("stack_layer", False):
                f.add(f"layer:{type(layer).__name__}")
            act = getattr(getattr(layer, "mlp", None), "act", None)  # (a routed-experts block has none)
            if act is not None:
                f.add(f"mlp_{act}")
        if c.rope_layers is not None and not all(c.rope_layers):
            f.add("nope_layers")
        if c.rotary_dims() != c.head_dim:
            f.add("partial_rotary")
        if c.rope_theta_local is not None and c.rope_theta_local != c.rope_theta:
            f.add("local_rotary_base")
        if c.qk_norm:
            f.add("qk_norm_over_heads" if c.qk_norm_over_heads else "qk_norm")
        if c.attention_bias:
            f.add("attention_bias")
        if c.sliding_window or c.layer_windows:
            f.add("window")
        if c.attn_softcap:
            f.add("attention_softcap")
        if c.moe is not None:
            f.add("experts")
            if c.moe.shared_intermediate_size:
                f.add("shared_expert")
        return frozenset(f)

    def reset_rope(self) -> None:
        """Empty rotary tables on the model's device (they grow with the positions served).
        Call again after moving the model: to_empty / .to(dtype) touch buffers too."""
        self.rotary.reset(rope_inv_freq(self.config, self.context), self.model.norm.weight.device,
                          rope_attention_factor(self.config))

    def set_context(self, context: int) -> None:
        """The engine's context window (LongRoPE picks its factors from it)."""
        self.context = context
        self.reset_rope()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take the tensors as they are (no copy): the model may have been built on the meta device."""
        state = fuse_projections(state)
        tie = self.config.tie_word_embeddings
        if tie:
            state.pop("lm_head.weight", None)
        place_quantized(self, state)  # weights kept in their file's block format
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (tie and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the architecture: missing {missing[:4]}, unexpected {unexpected[:4]}")
        if tie and isinstance(self.model.embed_tokens, QuantEmbedding):
            self.lm_head = QuantLinear([self.model.embed_tokens.table])  # the head reads the same blocks
        elif tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns fp32 logits for the rows in batch.logits_indices (all rows when None): the
        LM head is the largest matmul, so prefill asks only for the positions that sample."""
        return self.compute_logits(self.hidden_states(batch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normalised hidden states of the rows in batch.logits_indices: what the
        head reads, and what embeddings pool."""
        batch = batch.resolved(self.config)
        x = self.model.embed_tokens(batch.input_ids)
        dtype = x.dtype
        cos, sin = self.rotary(batch.positions, dtype)
        stack = decoder_stack.stack_for(self, batch)
        if stack is not None:
            x, residual = decoder_stack.run(stack, x, cos, sin, batch)
        else:
            residual = None
            for layer in self.model.layers:
                x, residual = layer(x, residual, cos, sin, batch)
        if batch.logits_indices is not None:  # (post-norm layers hand back the whole stream: no residual)
            x = x[batch.logits_indices]
            residual = None if residual is None else residual[batch.logits_indices]
        return self.model.norm(x, residual)[0]
