"""Gemma 2 and Gemma 3 (text): llama.py's attention (Gemma 3: with q/k RMSNorm per head), and around it
- the embeddings scaled by sqrt(hidden_size);
- norms on both sides of attention and of the MLP (input_layernorm, post_attention_layernorm,
  pre_feedforward_layernorm, post_feedforward_layernorm);
- a GELU (tanh) gated MLP;
- sliding-window layers and full ones (ModelConfig.layer_windows: Gemma 2 alternates, Gemma 3
  has five sliding to one full, each kind with its own rotary base, rope_theta_local);
- q.k scaled by query_pre_attn_scalar ** -0.5 (ModelConfig.attn_scale), the LM head tied;
- Gemma 2: attention scores and the final logits soft-capped (attn_softcap, final_softcap).

Norm weights: Gemma's RMSNorm multiplies by (1 + w). GGUF files store 1 + w already; a
Hugging Face checkpoint stores w, and 1 is added here at load, so the module multiplies by
the stored weight either way (in fp32, (1 + w) once is the same number as each time)."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from ..config import ModelConfig
from . import stack as decoder_stack
from .batch import ForwardBatch
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, rope_inv_freq
from .rotary import RotaryTable


class GemmaDecoderLayer(nn.Module):
    # llama.py's attention and MLP with the sandwich norms (norm_layout "sandwich"): what the
    # compiled decoder stack computes for it (models/stack.py), the windowed layers on the local tables
    stack_layer = True

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.sliding = config.windows()[layer] is not None
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config, "gelu_tanh")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x, rotary, batch: ForwardBatch):
        """x: the stream; rotary: {sliding: (cos, sin)}."""
        cos, sin = rotary[self.sliding]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)[0], cos, sin, batch))[0]
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)[0]))[0]


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.rotary_local = RotaryTable(rope_inv_freq(self._local(config)), config.max_position_embeddings)
        self.reset_rope()

    @staticmethod
    def _local(config: ModelConfig) -> ModelConfig:
        return replace(config, rope_theta=config.rope_theta_local or config.rope_theta, rope_scaling=None)

    def reset_rope(self) -> None:
        super().reset_rope()
        if hasattr(self, "rotary_local"):
            self.rotary_local.reset(rope_inv_freq(self._local(self.config)), self.model.norm.weight.device)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if "hf_config" in self.config.extra:  # Hugging Face stores w of (1 + w); GGUF stores 1 + w
            state = {k: (t + 1.0 if k.endswith("norm.weight") else t) for k, t in state.items()}
        super().load_weights(state)

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        batch = batch.resolved(self.config)
        x = self.model.embed_tokens(batch.input_ids)
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        rotary = {False: self.rotary(batch.positions, x.dtype), True: self.rotary_local(batch.positions, x.dtype)}
        stack = decoder_stack.stack_for(self, batch)
        residual = None
        if stack is not None:  # the layers' last output and the stream it joins: the norm adds them
            x, residual = decoder_stack.run(stack, x, *rotary[False], batch, rotary[True])
        else:
            for layer in self.model.layers:
                x = layer(x, rotary, batch)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
            residual = None if residual is None else residual[batch.logits_indices]
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.final_softcap:
            c = self.config.final_softcap
            logits = torch.tanh(logits / c) * c
        return logits
