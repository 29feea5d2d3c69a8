"""Architecture facts of a decoder-only transformer, independent of the file it came from."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3" | "mistral" (all served by models/llama.py)
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
    extra: dict = field(default_factory=dict)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def windows(self) -> list[int | None]:
        """The attention window of each layer (None = full causal)."""
        return list(self.layer_windows) if self.layer_windows is not None else [self.sliding_window] * self.num_layers
