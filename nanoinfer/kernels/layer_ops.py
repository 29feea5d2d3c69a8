"""A decoder layer's small operations: RMSNorm (with the residual add before it), rotary
embedding, the gated MLPs' silu(gate) * up and gelu_tanh(gate) * up.

Each function is written once in PyTorch, the formula as Hugging Face computes it, and
for fp32 and bf16 on the CPU runs as one compiled pass instead (csrc/layer_ops.cpp, which
rounds bf16 where torch does): at decode a layer is ~40 small ops whose dispatch costs
more than their arithmetic, and at prefill each op is another pass over memory. Tests
hold the two forms to each other.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels


def _compiled(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return (dtype in cpu_kernels.LAYER_OP_SUFFIXES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and cpu_kernels.library() is not None)


def _kernel(op: str, dtype: torch.dtype):
    return getattr(cpu_kernels.library(), f"{op}_{cpu_kernels.LAYER_OP_SUFFIXES[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """With a residual: residual + x is the new residual stream, and its norm the output.
    Returns (normalised, stream); without a residual, the stream is x itself.

    Normalises in fp32 whatever the dtype, as the reference does. The compiled form
    updates `residual` in place: callers own the stream."""
    given = [t for t in (weight, residual) if t is not None]
    if _compiled(x, *given) and (residual is None or residual.is_contiguous()):
        stream = residual if residual is not None else x.contiguous()
        add = x.contiguous() if residual is not None else None
        out = torch.empty_like(stream)
        _kernel("rms_norm", x.dtype)(stream.data_ptr(), add.data_ptr() if add is not None else None,
                                     weight.data_ptr() if weight is not None else None, out.data_ptr(),
                                     stream.numel() // stream.shape[-1], stream.shape[-1], eps)
        return out, stream
    stream = x if residual is None else residual + x
    normed = F.rms_norm(stream.float(), stream.shape[-1:], eps=eps).to(x.dtype)
    return (normed if weight is None else weight * normed), stream


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half layout (HF): the first and second halves of head_dim form the pairs.

    x: [T, heads, head_dim] (rows may be strided, as slices of a fused qkv); cos, sin:
    [T, 1, head_dim // 2]. Returns a new contiguous tensor."""
    T, heads, D = x.shape
    if _compiled(x, cos, sin):
        if x.stride(2) != 1 or x.stride(1) != D:  # a head's first part (partial rotary): the kernel's layout
            x = x.contiguous()
        out = x.new_empty(T, heads, D)
        cos, sin = cos.contiguous(), sin.contiguous()
        _kernel("rope", x.dtype)(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, heads, D)
        return out
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of the last dimension."""
    return _gated("silu_mul", gate_up, F.silu)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's MLP), gate and up the two halves of the last dimension."""
    return _gated("gelu_tanh_mul", gate_up, lambda g: F.gelu(g, approximate="tanh"))


def _gated(op: str, gate_up: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up: the compiled row op `op`, or the PyTorch formula."""
    if _compiled(gate_up):
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        _kernel(op, gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
