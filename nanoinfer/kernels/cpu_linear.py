"""Linear layers for the CPU, swapped in at load: each weight is reordered once into the
layout of the GEMM that runs it, instead of on every call as a plain F.linear does.

- bf16: oneDNN's blocked layout (`_reorder_linear_weight`); the layers' GEMMs run ~28%
  faster at decode batch sizes (1 to 32 rows) and ~20% faster at 1024 rows (SmolLM2-135M's
  shapes on an AMX CPU). Outputs matched plain F.linear exactly up to 64 rows and within
  bf16 rounding above.
- fp32: panels for the compiled GEMM (csrc/packed_gemm.cpp). MKL's sgemm repacks the
  weight on every call, which at decode batch sizes costs more than the arithmetic; the
  packed GEMM is as fast as MKL at 1 and 1024 rows and 1.3-2x faster in between. Sums run
  in another order than MKL's (results agree to ~1e-6), and each row's result is the same
  whatever the batch around it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels


@functools.cache
def packing_supported() -> bool:
    """This torch build has the oneDNN ops and this CPU runs them in bf16 (checked on a tiny GEMM)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w, x = torch.randn(24, 16).bfloat16(), torch.randn(3, 16).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return cpu_kernels.pack_f32(weight.contiguous())


class PackedLinear(nn.Module):
    """Computes what a CPU `linear` did, from a copy of its weight packed for the GEMM.

    An untied weight is replaced by its packed form (still a parameter, same shape, dtype
    and element count, so sizes and byte counts stay true). A head tied to the embedding
    keeps the dense table for lookups; its packed copy is a non-persistent buffer, so the
    tied table is still counted once."""

    def __init__(self, linear: nn.Linear, tied: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = _pack(linear.weight.detach())
        if tied:
            self.register_buffer("packed_weight", packed, persistent=False)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def packed(self) -> torch.Tensor:
        return self.packed_weight if hasattr(self, "packed_weight") else self.weight

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight in nn.Linear's layout (for checks and conversions)."""
        w = self.packed()
        return w.to_dense() if w.dtype == torch.bfloat16 else cpu_kernels.unpack_f32(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.packed()
        if w.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, self.bias, "none", [], "")
        y = cpu_kernels.linear_packed_f32(x.reshape(-1, self.in_features), w, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def _replacement(linear: nn.Linear, tied: bool) -> nn.Module | None:
    w = linear.weight
    packable = ((w.dtype == torch.bfloat16 and packing_supported())
                or (w.dtype == torch.float32 and cpu_kernels.library() is not None))
    return PackedLinear(linear, tied) if w.device.type == "cpu" and packable else None


def adapt_linears(model: nn.Module) -> int:
    """Swap `model`'s CPU nn.Linear layers for the faster forms above where they apply;
    returns how many were swapped. One at a time, holding no reference to the old layers,
    so each old weight is freed as soon as its packed copy exists."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    places = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, nn.Linear)]
    swapped = 0
    for parent, name in places:
        linear = getattr(parent, name)
        new = _replacement(linear, tied=id(linear.weight) in shared)
        if new is not None:
            setattr(parent, name, new)
            swapped += 1
        del linear
    return swapped
