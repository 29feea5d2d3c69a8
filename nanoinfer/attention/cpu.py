"""Paged attention on the CPU: prefill chunks as in the PyTorch backend, decodes in the
compiled kernel (csrc/paged_attention.cpp), which reads each sequence's blocks where they
lie instead of gathering them into a padded copy per layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_kernels
from .paged import PagedMetadata, TorchPagedAttention


@dataclass
class CpuPagedAttention(TorchPagedAttention):
    def decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               meta: PagedMetadata) -> None:
        p = self.params[layer]
        cpu_kernels.paged_decode(q, out, meta.decode_rows, kc, vc, meta.decode_tables, meta.decode_ctx,
                                 meta.decode_max_ctx, p.window, p.scale, p.softcap)

    @staticmethod
    def supported(cache_tensor: torch.Tensor) -> bool:
        return cpu_kernels.decode_supported(cache_tensor)
