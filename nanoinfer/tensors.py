"""A weight kept in its file's block format (GGUF Q4_0, Q4_K, F16, ...): the bytes as stored,
row by row, and what they mean. Loaders produce it, the model builder decides whether a kernel
runs it or it is dequantised, and the quantised linears in kernels/ consume it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class QuantizedTensor:
    data: torch.Tensor  # uint8 [rows, row_bytes]: each row is K / block_size blocks (often a view of the mapped file)
    qtype: int  # GGMLQuantizationType value
    shape: tuple[int, int]  # the logical [rows, K]
    type_name: str = ""  # "Q4_K", ... for messages
    repacked: bool = False  # rows in the kernels' repacked layout (kernels/csrc/quant/packed.h), not the file's
    # Drops the source's pages (a mapped file's) from memory: for whoever replaces `data` with a
    # copy, so that a load holds the file's pages of one tensor at a time, not all of them.
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def take_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """These rows, in this order (a copy): rows are whole blocks, so reordering them is exact."""
        assert not self.repacked, "rows of a repacked weight are not its tensor's rows"
        return QuantizedTensor(self.data.index_select(0, index), self.qtype, (len(index), self.shape[1]), self.type_name)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Rows of tensors of one type one after another (a copy)."""
        first = parts[0]
        assert all(p.qtype == first.qtype and p.shape[1] == first.shape[1] and not p.repacked for p in parts)
        return QuantizedTensor(torch.cat([p.data for p in parts]), first.qtype,
                               (sum(p.shape[0] for p in parts), first.shape[1]), first.type_name)
