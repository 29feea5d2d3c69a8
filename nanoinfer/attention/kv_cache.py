"""The KV pool's tensors: [layers, num_blocks, block_size, kv_heads, head_dim] for k and v.
Which block belongs to whom is the engine's KV manager's business; this is only storage."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch


@dataclass
class PagedKVCache:
    k: torch.Tensor
    v: torch.Tensor
    block_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_size = self.k.shape[2]

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device) -> PagedKVCache:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            return cls(_untouched_zeros(shape, dtype), _untouched_zeros(shape, dtype))
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.k.device)
            dst = torch.tensor([d for _, d in pairs], device=self.k.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping: the kernel hands out a page when it is first written, so
    a pool costs resident memory only for the blocks sequences have used (torch.zeros writes
    every page at once)."""
    buf = mmap.mmap(-1, max(1, math.prod(shape) * torch.empty(0, dtype=dtype).element_size()))
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
