"""Paged attention on the CPU in the C++ kernel (csrc/paged_attention.cpp), which reads each
sequence's blocks where they lie instead of gathering them into a padded copy per layer.

Every query row goes through it, prefill rows too: a row attends over the keys up to its
own position, as stored in the cache, in an order fixed by its position alone. So a row's
output is bit-identical however its prompt was chunked and whatever runs beside it, and a
chunk never attends to its own unrounded k/v while later steps read rounded ones."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_kernels
from .paged import PagedMetadata, TorchPagedAttention


@dataclass
class CpuPagedAttention(TorchPagedAttention):
    every_row_reads_the_cache = True  # prepare makes every row a one-row query (no prefill slices)
    fused_stack = True  # the compiled decoder stack attends with this same kernel over this same metadata

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        # decode_supported reads a cache tensor's device and dtype only: an empty one stands in
        return device.type == "cpu" and cpu_kernels.decode_supported(torch.empty(0, dtype=dtype))

    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               tables: torch.Tensor, meta: PagedMetadata) -> None:
        p = self.params[layer]
        cpu_kernels.paged_decode(q, out, meta.decode_rows, kc, vc, tables, meta.decode_ctx,
                                 meta.decode_max_ctx, p.window, p.scale, p.softcap)
