"""What every attention backend shares: the per-layer parameters, the interface a model
layer calls, and the dense attention the PyTorch paths are built from.

A layer computes q, k, v for a flat run of T new tokens and calls
`backend.forward(layer, q, k, v, metadata)`; the backend stores k and v where its cache
keeps them and returns the attention output. The metadata says, for this step, where
each token's k/v go and which keys each query sees; the model never reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..config import ModelConfig


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention: scores are q.k * scale, soft-capped to softcap * tanh(s / softcap)
    when softcap is set, over the last `window` keys when window is set."""

    scale: float
    window: int | None = None
    softcap: float | None = None


def layer_params(config: ModelConfig) -> list[AttentionParams]:
    scale = config.attn_scale if config.attn_scale is not None else 1.0 / math.sqrt(config.head_dim)
    return [AttentionParams(scale, window, config.attn_softcap) for window in config.windows()]


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""
        ...


def causal_mask(start: int, T: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, start + T] boolean mask: query i (absolute position start + i) sees key j
    when j <= start + i and, with a sliding window w, j > start + i - w."""
    q_pos = torch.arange(start, start + T, device=device).unsqueeze(1)
    k_pos = torch.arange(start + T, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, params: AttentionParams,
           causal: bool = False) -> torch.Tensor:
    """Batched heads: q [..., H, Tq, D], k/v [..., Hkv, S, D] -> [..., H, Tq, D]; grouped-query
    heads are shared, not copied. mask: boolean, broadcastable to [..., H, Tq, S]. Soft-capping
    has no SDPA kernel: those layers take the explicit softmax."""
    if params.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=params.scale, enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * params.scale
    scores = params.softcap * torch.tanh(scores / params.softcap)
    if mask is None and causal:
        mask = causal_mask(0, q.shape[-2], None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v.float()).to(q.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, params: AttentionParams,
         causal: bool = False) -> torch.Tensor:
    """One sequence: q [T, H, D], k/v [S, Hkv, D] -> [T, H, D]. Inputs go in as 4-D
    [1, heads, len, D]: PyTorch's CPU flash kernel takes only 4-D and falls back to the much
    slower math path for 3-D."""
    out = attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                 mask, params, causal)
    return out[0].transpose(0, 1)
