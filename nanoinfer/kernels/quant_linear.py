"""Linears and embeddings whose weights stay in their file's block format (GGUF Q4_K, Q8_0,
F16, ...), run by the kernels in csrc/quant_gemm.cpp. Activations go in and come out fp32.

A projection fused in the model (q, k, v; gate, up) may hold parts of different types (a
Q4_K_M file keeps v in Q6_K): each part runs as it is stored and the outputs are joined,
rather than copying the parts into one tensor.

Both repack their weights for the kernels when built (quant.repack: the block types, rows
interleaved 8 at a time); a head tied to the embedding is given the embedding's repacked
table, so the two still share one copy."""
from __future__ import annotations

import torch
from torch import nn

from ..tensors import QuantizedTensor
from . import quant


class QuantLinear(nn.Module):
    holds_weights = True  # its buffers are weights (they stay out of state_dict: not torch's format)

    def __init__(self, parts: list[QuantizedTensor], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = [_repacked(p) for p in parts]
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        for i, p in enumerate(self.parts):  # buffers: .to() and memory accounting see them; not in state_dict
            self.register_buffer(f"part{i}", p.data, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        ys = [quant.linear(x2, getattr(self, f"part{i}"), p.qtype, repacked=p.repacked) for i, p in enumerate(self.parts)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        types = "+".join(p.type_name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


class QuantEmbedding(nn.Module):
    """Rows gathered from the quantised table and dequantised: a lookup reads only its rows."""

    holds_weights = True

    def __init__(self, table: QuantizedTensor):
        super().__init__()
        self.table = table = _repacked(table)
        self.num_embeddings, self.embedding_dim = table.shape
        self.register_buffer("data", table.data, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = quant.dequantize_rows(self.data, self.table.qtype, self.embedding_dim, ids.reshape(-1).long(),
                                     self.table.repacked)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.type_name}"


def _repacked(t: QuantizedTensor) -> QuantizedTensor:
    """quant.repack(t); where that is a copy, t's source pages (a mapped file's) are dropped."""
    out = quant.repack(t)
    if out is not t and t.release is not None:
        t.release()
    return out


F32 = 0  # GGML's id of F32: kept as stored (an F32 file's experts), it is still the fp32 model's weight


def has_block_weights(model: nn.Module) -> bool:
    """Some weight of the model runs in its file's block format (F32 kept as stored does not
    count: the model then computes as the fp32 one does, and keeps its fp32 KV cache and peaks)."""
    for m in model.modules():
        tensors = m.parts if isinstance(m, QuantLinear) else [m.table] if isinstance(m, QuantEmbedding) else []
        if any(t.qtype != F32 for t in tensors):
            return True
    return False


def kernel_gap(t: QuantizedTensor) -> str | None:
    """Why no block kernel runs t (None: one does)."""
    if not quant.supported(t.qtype):
        return f"no kernel for {t.type_name}" if quant.paths() else "the compiled CPU kernels are unavailable"
    if t.shape[1] % quant.block_size(t.qtype):
        return f"rows of {t.shape[1]} values are not whole {t.type_name} blocks"
    return None


def parameter_count(model: nn.Module) -> int:
    """Parameters, counting a block-format weight by its logical size (rows x columns) and a
    table shared by a tied head once."""
    seen: set[int] = set()
    count = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        tensors = m.parts if isinstance(m, QuantLinear) else [m.table] if isinstance(m, QuantEmbedding) else []
        for t in tensors:
            if t.data.data_ptr() not in seen:
                seen.add(t.data.data_ptr())
                count += t.shape[0] * t.shape[1]
        if isinstance(m, QuantLinear) and m.bias is not None:
            count += m.bias.numel()
    return count
