"""Putting weights that stay in block format into a built model: the nn.Linear or
nn.Embedding that would hold each one becomes its quantised form (kernels/quant_linear.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.quant_linear import QuantEmbedding, QuantLinear
from ..tensors import QuantizedTensor


def cat_rows(parts: list) -> torch.Tensor | list[QuantizedTensor]:
    """Projections fused along the output rows: dense ones concatenated, quantised ones kept
    as parts (each runs in its own format; see QuantLinear)."""
    if any(isinstance(p, QuantizedTensor) for p in parts):
        if not all(isinstance(p, QuantizedTensor) for p in parts):
            raise ValueError("a fused projection mixes quantised and dense parts")
        return list(parts)
    return torch.cat(parts, dim=0)


def place_quantized(model: nn.Module, state: dict) -> None:
    """Take every quantised weight out of `state` and swap its module for the quantised form
    (a linear's dense bias goes with it)."""
    for key in [k for k, v in state.items() if isinstance(v, (QuantizedTensor, list))]:
        path = key.removesuffix(".weight")
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, name)
        value = state.pop(key)
        parts = value if isinstance(value, list) else [value]
        if isinstance(old, nn.Embedding):
            new = QuantEmbedding(parts[0])
        elif isinstance(old, nn.Linear):
            new = QuantLinear(parts, state.pop(f"{path}.bias", None))
        else:
            raise ValueError(f"{key}: a quantised weight for a {type(old).__name__}")
        if _shape(new) != tuple(old.weight.shape):
            raise ValueError(f"{key}: shape {list(_shape(new))} where the architecture has {list(old.weight.shape)}")
        setattr(parent, name, new)


def _shape(module: QuantLinear | QuantEmbedding) -> tuple[int, int]:
    if isinstance(module, QuantEmbedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features
