"""OLMo 2: the Llama module's attention and MLP with the norms moved. No norm before
attention or the MLP; an RMSNorm on each branch's output before it joins the stream
(post_attention_layernorm, post_feedforward_layernorm), and q and k each RMS-normed over all
their heads at once before rotary (ModelConfig.qk_norm_over_heads, in llama.Attention).

The compiled decoder stack runs these layers too (its post-norm layout: stack_layer below)."""
from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from .batch import ForwardBatch
from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm


class Olmo2DecoderLayer(nn.Module):
    stack_layer = True  # the Llama module's parts in the post-norm layout, which the stack computes

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch: ForwardBatch):
        """x: the stream (residual is always None here: each layer returns the whole stream)."""
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, batch))[0]
        x = x + self.post_feedforward_layernorm(self.mlp(x))[0]
        return x, None


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer
