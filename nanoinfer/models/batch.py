"""The one argument of every model's forward: what to compute this step and how to attend."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..attention import AttentionBackend, CausalAttention, layer_params
from ..config import ModelConfig


@dataclass
class ForwardBatch:
    """A flat run of tokens from one or several sequences (or chunks of them).

    The attention backend and its step metadata say which keys each query sees and where
    new k/v are stored; with no backend the run is one sequence, attended causally without
    a cache (the reference loop). The model reads the rest and never sees requests."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBackend | CausalAttention | None = None
    attn_metadata: Any = None  # what attention.prepare built for this step
    logits_indices: torch.Tensor | None = None  # rows whose logits are wanted; None: all T
    prev_ids: torch.Tensor | None = None  # each token's predecessor in its sequence, -1 at position 0

    @classmethod
    def whole(cls, input_ids: torch.Tensor, **fields) -> ForwardBatch:
        """One uncached sequence from position 0."""
        return cls(input_ids, torch.arange(len(input_ids), device=input_ids.device), **fields)

    def resolved(self, config: ModelConfig) -> ForwardBatch:
        """This batch with its backend set: causal and uncached when none was given."""
        return self if self.attention is not None else replace(self, attention=CausalAttention(layer_params(config)))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention.forward(layer, q, k, v, self.attn_metadata)
