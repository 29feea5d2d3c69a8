"""The KV pool's tensors and the formats a token's k and v are stored in. Which block belongs
to whom is the engine's KV manager's business; this is only storage.

Layers are grouped by their attention window (`kv_groups`; vLLM's KV cache groups): the layers
that see every key form one group, each sliding window another. Each group has its own pool,
[group's layers, num_blocks, block_size, kv_heads, D'] for k and for v, with its own block ids,
so a windowed group can give back a block once it has slid past it while the full layers still
hold theirs (Gemma 3's five local layers in six then cost about their window, not the context).
Block 0 of a windowed group's pool is its null block: never handed out, it stands in a block
table where blocks have slid out of the window (the kernels never read keys there).

Formats (the cache tensor's dtype names them):
- float32, bfloat16, float16: each value as that dtype (D' = head_dim);
- Q8_0 (stored as uint8): each head's row of head_dim values in GGML's q8_0 blocks, 34 bytes
  per 32 values (an fp16 scale d, then 32 int8 q; D' = head_dim / 32 * 34, 0.53x bf16's bytes).
  A token's blocks depend on that token alone (no scale is shared with tokens written later),
  so chunking and batching change nothing. A block's scale is the best of 15 candidates,
  d16 = fp16(max|x| * (1/n)) for n = 127, 126.5, ..., 120 (`Q8_SCALE_DIVISORS`; 1/n in fp32):
  each quantises q = round-half-even(x * (1/d16)) clamped to +-127, so q is rounded against the
  scale read back, and the one whose read-back q * d16 has the smallest squared error over the
  block is kept (the first of equals), as llama.cpp's make_qx_quants searches its k-quants'
  scales. The error is d16^2 * sum(f^2), f = q - x * (1/d16) rounded to 1/4096 of a step: whole
  numbers in float64, exact in any order, so PyTorch and the C++ (-ffast-math) pick the same
  candidate. Against the single scale max|x| / 127 this takes a fifth off the squared error, and
  Qwen2.5-Coder 0.5B's perplexity cost from +0.58% to +0.17% / +0.42% at ctx 512 / 2048
  (docs/benchmarks.md). Read back as q * d16, exactly. Every query, the writing step's own
  included, attends over the values as read back.
  Before quantising, k and v are rotated by an orthonormal Walsh-Hadamard transform in blocks
  (`rotations`; llama.cpp does the same for its quantised caches): an outlier channel (Qwen's
  k has some) is spread over its block instead of setting a scale that crushes the rest
  (Qwen2.5-Coder 0.5B, ctx 512: k unrotated cost +1.7% perplexity). The attention then runs
  in the rotated space: queries rotated like k (q . k unchanged), the output rotated back like
  v (the transform is its own inverse).
"""
from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass, field

import torch

from ..kernels import cpu_kernels

Q8_0 = torch.uint8  # the q8_0 format's storage dtype: the cache dtype that names it
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def is_q8(dtype: torch.dtype) -> bool:
    return dtype == Q8_0


def format_name(dtype: torch.dtype) -> str:
    """The name kv_cache_dtype takes for this format: "q8_0", "bfloat16", ..."""
    return "q8_0" if is_q8(dtype) else str(dtype).removeprefix("torch.")


def stored_dim(dtype: torch.dtype, head_dim: int) -> int:
    """The cache tensor's last dimension: values, or bytes of q8_0 blocks."""
    if is_q8(dtype):
        if head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs a head size that is a multiple of 32, not {head_dim}")
        return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES
    return head_dim


@functools.cache  # (asked by every layer of every step)
def rotations(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """The rotation blocks of k and v in this format (0: none); csrc/common.h's k_rotation, v_rotation."""
    if not is_q8(dtype) or head_dim % 64:
        return 0, 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n, 64


def rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., head_dim] with each block of n values Walsh-Hadamard transformed (orthonormal, its
    own inverse): the C++ transform on the CPU (the decoder stack's), the same steps in PyTorch elsewhere."""
    if not n:
        return x
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.library() is not None:
        return cpu_kernels.kv_rotate(x, n)
    *lead, D = x.shape
    v = x.float().reshape(-1, D // n, n)
    h = 1
    while h < n:
        v = v.reshape(v.shape[0], D // n, n // (2 * h), 2, h)
        a, c = v[..., 0, :], v[..., 1, :]
        v = torch.stack([a + c, a - c], dim=-2).reshape(-1, D // n, n)
        h *= 2
    return (v * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)).reshape(*lead, D).to(x.dtype)


def value_bytes(dtype: torch.dtype) -> float:
    """Bytes per stored value: what the pool's size rule counts."""
    return Q8_BLOCK_BYTES / Q8_BLOCK if is_q8(dtype) else torch.empty(0, dtype=dtype).element_size()


def store(x: torch.Tensor, dtype: torch.dtype, rot: int = 0) -> torch.Tensor:
    """x [..., head_dim] as the cache stores it (q8_0: [..., stored_dim] bytes), rotated first
    by blocks of `rot` values (`rotations`)."""
    if not is_q8(dtype):
        return x.to(dtype)
    if x.device.type == "cpu" and cpu_kernels.library() is not None:  # the decoder stack writes with it too
        return cpu_kernels.kv_quantize_q8(x, rot)
    return quantize_q8(rotate(x.float(), rot))


# The candidate scales of a q8_0 block: d = max|x| / n for each n (csrc/common.h's kQ8Factors)
Q8_SCALE_DIVISORS = tuple(127 - 0.5 * j for j in range(15))


@functools.cache
def _q8_factors(device: torch.device) -> torch.Tensor:
    return torch.tensor([1.0 / n for n in Q8_SCALE_DIVISORS], dtype=torch.float32, device=device)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """The q8_0 format in PyTorch (any device); csrc's kv_quantize_q8 gives the same bytes.
    Every candidate scale of a block is tried at once ([..., blocks, candidates, 32])."""
    *lead, D = x.shape
    xb = x.float().reshape(*lead, D // Q8_BLOCK, 1, Q8_BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    d = (amax * _q8_factors(x.device).view(-1, 1)).half().float()  # [..., blocks, candidates, 1]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros((), device=x.device))
    r = xb * inv
    q = torch.round(r).clamp(-127, 127)
    f = torch.round((q - r) * 4096.0).double()  # the step's fraction to 1/4096: whole numbers, exact sums
    err = d.double() * d.double() * (f * f).sum(-1, keepdim=True)
    err = torch.where(torch.isnan(err), torch.tensor(math.inf, dtype=torch.float64, device=x.device), err)
    best = err.argmin(-2, keepdim=True)  # the first of equals, as the C++ loop keeps it
    d = d.gather(-2, best)
    q = q.gather(-2, best.expand(*best.shape[:-1], Q8_BLOCK))
    blocks = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=-1)
    return blocks.reshape(*lead, D // Q8_BLOCK * Q8_BLOCK_BYTES)


def read(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored k or v as values of `dtype` (the queries')."""
    if not is_q8(stored.dtype):
        return stored.to(dtype)
    *lead, nbytes = stored.shape
    blocks = stored.reshape(*lead, nbytes // Q8_BLOCK_BYTES, Q8_BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(*lead, nbytes // Q8_BLOCK_BYTES * Q8_BLOCK).to(dtype)


@dataclass(frozen=True)
class KVGroup:
    """Layers that share a pool and a block table: those with one attention window."""

    window: int | None  # None: every key (full causal attention)
    layers: tuple[int, ...]


def kv_groups(windows: list[int | None], max_model_len: int, by_window: bool = True) -> list[KVGroup]:
    """The layers grouped by window: the full layers first (a window at least the context is
    full), then each window, smallest first. by_window=False: one group, every layer (windows
    still apply in attention; only memory is not given back)."""
    if not by_window:
        return [KVGroup(None, tuple(range(len(windows))))]
    key = [None if w is None or w >= max_model_len else w for w in windows]
    order = sorted(set(key), key=lambda w: -1 if w is None else w)
    return [KVGroup(w, tuple(i for i, k in enumerate(key) if k == w)) for w in order]


@dataclass
class PagedKVCache:
    """One pool per KV group: k[g], v[g] are [group's layers, blocks of group g, block_size, Hkv, D']."""

    groups: list[KVGroup]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int = field(init=False)
    layer_place: list[tuple[int, int]] = field(init=False)  # layer -> (group, index in the group's pool)

    def __post_init__(self) -> None:
        self.block_size = self.k[0].shape[2]
        place = {layer: (g, i) for g, group in enumerate(self.groups) for i, layer in enumerate(group.layers)}
        self.layer_place = [place[layer] for layer in range(len(place))]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def group_of(self, layer: int) -> int:
        return self.layer_place[layer][0]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's k and v pools, [blocks, block_size, Hkv, D'] each."""
        g, i = self.layer_place[layer]
        return self.k[g][i], self.v[g][i]

    @classmethod
    def allocate(cls, groups: list[KVGroup], num_blocks: list[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device) -> PagedKVCache:
        """num_blocks: each group's pool."""
        make = _untouched_zeros if torch.device(device).type == "cpu" else \
            (lambda shape, dt: torch.zeros(shape, dtype=dt, device=device))
        k, v = [], []
        for group, n in zip(groups, num_blocks):
            shape = (len(group.layers), n, block_size, num_kv_heads, stored_dim(dtype, head_dim))
            k.append(make(shape, dtype))
            v.append(make(shape, dtype))
        return cls(groups, k, v)

    def copy_blocks(self, pairs: list[list[tuple[int, int]]]) -> None:
        """pairs[g]: group g's (source, destination) block copies."""
        for k, v, group_pairs in zip(self.k, self.v, pairs):
            if group_pairs:
                src = torch.tensor([s for s, _ in group_pairs], device=k.device)
                dst = torch.tensor([d for _, d in group_pairs], device=k.device)
                k[:, dst] = k[:, src]
                v[:, dst] = v[:, src]


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping: the kernel hands out a page when it is first written, so
    a pool costs resident memory only for the blocks sequences have used (torch.zeros writes
    every page at once)."""
    buf = mmap.mmap(-1, max(1, math.prod(shape) * torch.empty(0, dtype=dtype).element_size()))
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
