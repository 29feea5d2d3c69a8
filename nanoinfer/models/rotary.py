"""Rotary tables that grow with the positions actually served.

cos/sin of position x inverse frequency, in fp32 whatever the weights' dtype. A model's
declared context (Llama 3.1 says 131072, some say 1M) would cost 512 MB and more as one
table built at load; the table is built in chunks as positions arrive instead. Each chunk
is computed alone, so a position's values never depend on how far the table has grown:
a request's logits cannot change because a longer one ran beside it.
"""
from __future__ import annotations

import torch
from torch import nn

CHUNK = 4096  # positions per chunk


class RotaryTable(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, max_positions: int):
        super().__init__()
        self.max_positions = max_positions
        self.scale = 1.0
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def reset(self, inv_freq: torch.Tensor, device: torch.device, scale: float = 1.0) -> None:
        """Fresh (empty) tables on `device`: after building on the meta device or moving the model.
        scale multiplies cos and sin (LongRoPE's attention factor)."""
        self.inv_freq = inv_freq.float().to(device)
        self.scale = scale
        self.cos = self.sin = torch.empty(0, inv_freq.numel(), device=device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [T, 1, head_dim / 2] in `dtype`."""
        if positions.numel():
            self._grow(int(positions.max()) + 1)
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def _grow(self, needed: int) -> None:
        have = self.cos.shape[0]
        if needed <= have:
            return
        if needed > self.max_positions:
            raise ValueError(f"position {needed - 1} is past the model's context of {self.max_positions}")
        cos, sin = [self.cos], [self.sin]
        for start in range(have, min(-(-needed // CHUNK) * CHUNK, self.max_positions), CHUNK):
            end = min(start + CHUNK, self.max_positions)
            freqs = torch.outer(torch.arange(start, end, dtype=torch.float32, device=self.inv_freq.device),
                                self.inv_freq)
            if self.scale == 1.0:
                cos.append(freqs.cos())
                sin.append(freqs.sin())
            else:
                cos.append(freqs.cos() * self.scale)
                sin.append(freqs.sin() * self.scale)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)
