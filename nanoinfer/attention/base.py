"""What every attention backend shares: the per-layer parameters, the step as the runner
describes it, the interface a backend implements, and the dense attention the PyTorch paths
are built from.

Once per step the runner describes its batch in an AttentionBatch and the backend's
`prepare` turns that into metadata of its own (slot tensors, padded block tables,
cu_seqlens, whatever its kernel reads). Then each layer computes q, k, v for the flat run
of T new tokens and calls `backend.forward(layer, q, k, v, metadata)`; the backend stores k
and v where its cache keeps them and returns the attention output. The model never reads
the metadata.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .kv_cache import PagedKVCache


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


def index_tensor(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of a list (or a list of equal lists) of Python ints, as torch.tensor
    makes it at several times the speed: numpy converts a 32 x 32 block table in 30 us, torch
    in 280, and a step makes a handful of these tensors."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


@dataclass(slots=True)
class AttentionBatch:
    """One step's sequences as the runner hands them to every backend (vLLM v1's
    CommonAttentionMetadata), still Python lists: each backend's `prepare` makes tensors, in
    its own layout, of what it reads and nothing else. Sequence i's new tokens are rows
    query_start_loc[i] .. query_start_loc[i + 1] of the flat batch, at the last positions of
    its seq_lens[i] keys."""

    query_start_loc: list[int]  # [S + 1], ends with T
    seq_lens: list[int]  # [S] keys each sequence has once this step's are stored: cached + new
    # per KV group (kv_cache.kv_groups), [G][S]: each sequence's block ids in that group's pool (at
    # least ceil(seq_len / block_size); a windowed group's null block 0 where blocks slid out)
    block_tables: list[list[list[int]]]
    slot_mapping: list[list[int]]  # [G][T] where each new token's k/v go in group g: block * block_size + offset
    positions: list[int]  # [T]
    logits_indices: list[int]  # rows whose logits are wanted


@dataclass
class AttentionBackend(ABC):
    """Attention over the paged KV pool. A backend is one subclass (built with the layers'
    params and the pool) and one `register_backend(name, cls)` line (registry.py)."""

    params: list[AttentionParams]  # per layer
    cache: PagedKVCache
    # An allow-list: True lets the compiled decoder stack (models/stack.py) run a step in the
    # layers' place, attending as csrc/paged_attention.cpp does over the PagedMetadata this
    # backend prepared with every row a one-row query. Only a backend computing those bits may say so.
    fused_stack: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether it runs on this device over a KV cache of this dtype: asked before the
        pool exists, of each registered backend in order by "auto", of a named one to refuse it."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any:
        """This step's metadata in the backend's own type: built once per step, handed to
        every layer's `forward`."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens, stored before attending.
        Returns [T, H, D]."""


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
