"""Architecture facts of a decoder-only transformer, independent of the file it came from."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelLoadError

# Size fields beyond this are corrupt or hostile whatever the model (int32 indexing).
MAX_SIZE = (1 << 31) - 1


@dataclass
class MoeSpec:
    """A mixture-of-experts MLP: each token goes to the top_k of num_experts routed experts
    (softmax over the router's logits, top_k kept, renormalised to sum 1 when norm_topk_prob),
    plus, in Qwen2-MoE, a shared expert gated by sigmoid(shared_expert_gate(x))."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    norm_topk_prob: bool
    shared_intermediate_size: int | None = None
    sparse_layers: list[bool] | None = None  # per layer: experts (True) or the dense MLP; None: all experts


@dataclass
class ModelConfig:
    architecture: str  # a registered family's name ("llama", "qwen3", "gemma3", "nanochat", ...: registry.ARCHITECTURES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    rope_scaling: dict | None = None  # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys
    layer_windows: list[int | None] | None = None  # per-layer windows (nanochat); overrides sliding_window
    attn_scale: float | None = None  # softmax scale of q.k; None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # attention scores soft-capped to c * tanh(s / c) (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped the same way (Gemma 2)
    rope_layers: list[bool] | None = None  # per layer: rotary applied (SmolLM3 skips every 4th); None: all
    qk_norm_over_heads: bool = False  # with qk_norm: one RMSNorm over all of q's (k's) heads (OLMo 2)
    norm_layout: str = "pre"  # "pre": norms before attention and MLP (Llama); "post": after each (OLMo 2);
    #                           "sandwich": both (Gemma 3)
    rope_theta_local: float | None = None  # rotary base of the sliding-window layers (Gemma 3); None: rope_theta
    rotary_dim: int | None = None  # rotary on the first rotary_dim dims of each head (Phi-4-mini); None: all
    moe: MoeSpec | None = None  # experts in place of the MLP (Qwen2-MoE, Qwen3-MoE, Mixtral)
    # Facts without a field: the family's own (its registry entry's config_keys, by name; nanochat's
    # era constants) and the file's fields as read ("hf_config", "gguf_fields")
    extra: dict = field(default_factory=dict)

    def kv_bytes_per_token(self, value_bytes: float) -> int:
        """K and V of one token in every layer, at value_bytes a value (q8_0: 34 / 32)."""
        return math.ceil(self.num_layers * 2 * self.num_kv_heads * self.head_dim * value_bytes)

    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def sparse(self, layer: int) -> bool:
        """The layer's MLP is a mixture of experts."""
        return self.moe is not None and (self.moe.sparse_layers is None or self.moe.sparse_layers[layer])

    def windows(self) -> list[int | None]:
        """The attention window of each layer (None = full causal)."""
        return list(self.layer_windows) if self.layer_windows is not None else [self.sliding_window] * self.num_layers


# Loaders check a file's fields with these before anything is sized from them; `name` is the
# field as the file spells it, so that the one-line ModelLoadError points at it.

def check_int(value: Any, name: str, lo: int = 1, hi: int = MAX_SIZE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelLoadError(f"{name} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def check_number(value: Any, name: str, allow_zero: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or value == 0 and not allow_zero):
        raise ModelLoadError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, "
                             f"got {value!r:.40}")
    return float(value)


def check_finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"{name} must be a finite number, got {value!r:.40}")
    return float(value)


def check_layer_count(n: int, indices: set[int], name: str) -> None:
    """The layer count a file states against the layers its tensors hold (0 .. n-1)."""
    if n != len(indices):
        raise ModelLoadError(f"{name} {n} does not match the {len(indices)} layers of weights in the file")
