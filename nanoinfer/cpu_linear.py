"""Linear layers for the CPU, swapped in at load: what a plain F.linear wastes at the sizes
an inference engine runs.

- bf16 (`PackedLinear`): a plain bf16 F.linear reorders the weight into oneDNN's blocked
  layout on every call; doing it once at load makes the layers' GEMMs ~28% faster at
  decode batch sizes (1 to 32 rows) and ~20% faster at 1024 rows (SmolLM2-135M's shapes on
  an AMX CPU). Outputs matched plain F.linear exactly up to 64 rows and within bf16
  rounding above.
- fp32 (`SmallBatchLinear`): for 4 to 32 rows, MKL's sgemm repacks the weight on every
  call; the compiled small-batch GEMM (csrc/small_gemm.cpp) streams it once instead: a
  decode step at batch 8 takes 78-81 ms instead of 111-116 ms (SmolLM2-135M, same tokens).
  At one row MKL's GEMV already runs at the memory's speed, and from about 32 rows MKL
  is as fast or faster, so both stay with F.linear. Sums run in another order than
  MKL's: results agree to ~1e-6.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

SMALL_BATCH_ROWS = (4, 32)  # rows of x for which the compiled fp32 GEMM beats MKL (measured)


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


class PackedLinear(nn.Module):
    """Computes what a bf16 `linear` did, from the packed copy of its weight.

    An untied weight is replaced by its packed form (still a parameter, same shape and
    dtype, so sizes and byte counts stay true). A head tied to the embedding keeps the
    dense table for lookups; its packed copy is a non-persistent buffer, so the tied
    table is still counted once."""

    def __init__(self, linear: nn.Linear, tied: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        if tied:
            self.register_buffer("packed_weight", packed, persistent=False)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.packed_weight if hasattr(self, "packed_weight") else self.weight
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, self.bias, "none", [], "")


class SmallBatchLinear(nn.Module):
    """An fp32 `linear` with the same weight and bias (shared, not copied: a tied head stays
    tied) that sends decode-sized batches to the compiled GEMM."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and SMALL_BATCH_ROWS[0] <= x.shape[0] <= SMALL_BATCH_ROWS[1]:
            return cpu_kernels.linear_f32(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _replacement(linear: nn.Linear, tied: bool) -> nn.Module | None:
    w = linear.weight
    if w.device.type != "cpu":
        return None
    if w.dtype == torch.bfloat16 and packing_supported():
        return PackedLinear(linear, tied)
    if (w.dtype == torch.float32 and w.is_contiguous() and (linear.bias is None or linear.bias.is_contiguous())
            and cpu_kernels.library() is not None):
        return SmallBatchLinear(linear)
    return None


def adapt_linears(model: nn.Module) -> int:
    """Swap `model`'s CPU nn.Linear layers for the faster forms above where they apply;
    returns how many were swapped."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new = _replacement(child, tied=id(child.weight) in shared)
                if new is not None:
                    setattr(parent, name, new)
                    swapped += 1
    return swapped
