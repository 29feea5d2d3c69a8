"""Tensor parallelism, Megatron style: one rank's share of a loaded model, taken in place.

- Attention: each rank keeps num_heads/N query heads and num_kv_heads/N key/value heads (the
  matching rows of the fused qkv_proj and its bias) and the same columns of o_proj, whose
  partial output is summed over the ranks (one all-reduce after attention).
- MLP: the rank's columns of gate and up (rows of gate_up_proj) and the same rows of
  down_proj's input; one all-reduce after the MLP. Mixture of experts: every expert (and the
  shared one) split the same way, the router kept whole, one all-reduce after the block.
- Vocabulary: each rank holds vocab/N rows of the embedding (a lookup outside them gives
  zeros; an all-reduce joins them) and of the LM head, whose logits are all-gathered.
- OLMo 2's q/k norm over all heads: its sum of squares is all-reduced.
- Everything else (norms, a family's own vectors) is kept whole on every rank. A family whose
  layers follow these rules says so in its registry entry (tensor_parallel); no list here.

Weights in GGUF blocks split on row boundaries exactly (rows are whole blocks); a column
split lands on block boundaries when in_features/N is a multiple of the block size, and
otherwise that layer runs dequantised (one line on stderr says which).
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace

import torch
from torch import nn

from .. import registry
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..kernels.cpu_linear import PackedLinear, adapt_linears
from ..kernels.quant import as_stored, block_size
from ..kernels.quant_linear import QuantEmbedding, QuantLinear
from ..loaders.gguf import dequantize
from ..tensors import QuantizedTensor
from . import parallel


def check_divisible(config: ModelConfig, world: int) -> None:
    """A one-line error when the model cannot be split `world` ways. Which families these split
    rules hold for is a fact of each family's (its registry entry's tensor_parallel)."""
    if not registry.by_name(config.architecture).tensor_parallel:
        raise ModelLoadError(f"tensor parallelism is not implemented for {config.architecture} (it is for "
                             f"{', '.join(a.name for a in registry.ARCHITECTURES if a.tensor_parallel)})")
    for what, n in (("query heads", config.num_heads), ("key/value heads", config.num_kv_heads),
                    ("vocabulary", config.vocab_size), ("MLP width", config.intermediate_size)):
        if n % world:
            raise ModelLoadError(f"tensor_parallel_size={world} does not divide the model's {n} {what}")
    if config.moe is not None:
        for what, n in (("expert width", config.moe.intermediate_size),
                        ("shared expert width", config.moe.shared_intermediate_size or 0)):
            if n % world:
                raise ModelLoadError(f"tensor_parallel_size={world} does not divide the model's {n} {what}")


def rank_config(config: ModelConfig, world: int) -> ModelConfig:
    """What one rank's attention and KV pool hold: its heads."""
    return replace(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world)


def shard_model(model: nn.Module, config: ModelConfig, rank: int, world: int) -> nn.Module:
    """Keep rank `rank`'s share of `model` (built and loaded whole) and wire in the collectives."""
    check_divisible(config, world)
    model.use_decoder_stack = False  # the compiled stack runs whole layers
    H, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    h, hkv = H // world, Hkv // world
    q_rows, kv_rows = (rank * h * D, (rank + 1) * h * D), (rank * hkv * D, (rank + 1) * hkv * D)
    dequantised: list[str] = []
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.qkv_proj = _rows(attn.qkv_proj, [q_rows, _shift(kv_rows, H * D), _shift(kv_rows, (H + Hkv) * D)])
        attn.o_proj = AllReduce(_cols(attn.o_proj, *q_rows, dequantised))
        attn.num_heads, attn.num_kv_heads = h, hkv
        if attn.qk_norm_over_heads:
            attn.q_norm = ShardedRMSNorm(attn.q_norm, *q_rows, H * D)
            attn.k_norm = ShardedRMSNorm(attn.k_norm, *kv_rows, Hkv * D)
        mlp = layer.mlp
        for expert in _mlps(mlp):
            inter = expert.down_proj.in_features
            cols = (rank * inter // world, (rank + 1) * inter // world)
            expert.gate_up_proj = _rows(expert.gate_up_proj, [cols, _shift(cols, inter)])
            expert.down_proj = _cols(expert.down_proj, *cols, dequantised)
        layer.mlp = AllReduce(mlp)
    vocab = (rank * config.vocab_size // world, (rank + 1) * config.vocab_size // world)
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabShardEmbedding(_embedding_rows(embed, *vocab), vocab[0])
    if config.tie_word_embeddings:
        table = model.model.embed_tokens.inner
        head = (QuantLinear([table.table]) if isinstance(table, QuantEmbedding)
                else _linear_from(table.weight, None))
    else:
        head = _rows(model.lm_head, [vocab])
    model.lm_head = GatherVocab(head)
    if dequantised and rank == 0:
        kinds = ", ".join(f"{n} x {k}" for k, n in Counter(dequantised).items())
        print(f"nanoinfer: tensor parallel: {len(dequantised)} weights split inside their blocks run dequantised "
              f"({kinds})", file=sys.stderr)
    adapt_linears(model)  # the new dense linears packed for the CPU GEMM
    return model


# --- collectives around modules -------------------------------------------------------------
class AllReduce(nn.Module):
    """The wrapped module's output summed over the ranks (it computed a partial sum)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return parallel.all_reduce(self.inner(*args, **kwargs))


class GatherVocab(nn.Module):
    """The LM head on this rank's vocabulary rows; the logits of all ranks joined in vocab order."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel.all_gather_last(self.inner(x))


class VocabShardEmbedding(nn.Module):
    """Rows start .. start + n of the table: ids elsewhere look up zeros, the ranks' rows are summed."""

    def __init__(self, inner: nn.Module, start: int):
        super().__init__()
        self.inner, self.start = inner, start
        self.rows = inner.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = self.inner(torch.where(mine, local, torch.zeros_like(local)))
        return parallel.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ShardedRMSNorm(nn.Module):
    """OLMo 2's RMSNorm over all heads of q (k), on this rank's heads: the sum of squares is all-reduced."""

    def __init__(self, norm: nn.Module, start: int, end: int, total: int):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach()[start:end].clone(), requires_grad=False)
        self.eps, self.total = norm.eps, total

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        squares = parallel.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        return (x.float() * torch.rsqrt(squares / self.total + self.eps)).to(x.dtype) * self.weight, x


# --- taking rows and columns ----------------------------------------------------------------
def _shift(span: tuple[int, int], by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by


def _mlps(mlp: nn.Module) -> list[nn.Module]:
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return [mlp]
    return [*experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]


def _dense(linear: nn.Module) -> torch.Tensor:
    return linear.dense_weight() if isinstance(linear, PackedLinear) else linear.weight.detach()


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    # (a Parameter stays itself: a head tied to the embedding shares it, counted once)
    out.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def _rows(linear: nn.Module, spans: list[tuple[int, int]]) -> nn.Module:
    """The output rows in `spans`, in order (a copy)."""
    bias = linear.bias.detach() if linear.bias is not None else None
    bias = None if bias is None else torch.cat([bias[s:e] for s, e in spans]).clone()
    if not isinstance(linear, QuantLinear):
        w = _dense(linear)
        return _linear_from(torch.cat([w[s:e] for s, e in spans]).clone(), bias)
    parts = []
    for s, e in spans:  # a span may cross the parts of a fused projection
        offset = 0
        for p in map(as_stored, linear.parts):
            lo, hi = max(s, offset), min(e, offset + p.shape[0])
            if lo < hi:
                parts.append(QuantizedTensor(p.data[lo - offset:hi - offset].clone(), p.qtype, (hi - lo, p.shape[1]),
                                             p.type_name))
            offset += p.shape[0]
    return QuantLinear(parts, bias)


def _cols(linear: nn.Module, start: int, end: int, dequantised: list[str]) -> nn.Module:
    """The input columns start .. end (a copy); no bias (the row-parallel layers have none).
    A block format split inside its blocks is dequantised (and named in `dequantised`)."""
    if not isinstance(linear, QuantLinear):
        return _linear_from(_dense(linear)[:, start:end].contiguous(), None)
    parts = []
    for p in map(as_stored, linear.parts):
        bs = block_size(p.qtype)
        if start % bs or end % bs:
            dequantised.append(f"{p.type_name} [{p.shape[0]}, {p.shape[1]}]")
            dense = torch.cat([dequantize(as_stored(q)) for q in linear.parts])
            return _linear_from(dense[:, start:end].contiguous(), None)
        per = p.data.shape[1] // (p.shape[1] // bs)  # bytes per block
        parts.append(QuantizedTensor(p.data[:, start // bs * per:end // bs * per].contiguous(), p.qtype,
                                     (p.shape[0], end - start), p.type_name))
    return QuantLinear(parts, None)


def _embedding_rows(embed: nn.Module, start: int, end: int) -> nn.Module:
    if isinstance(embed, QuantEmbedding):
        t = as_stored(embed.table)
        return QuantEmbedding(QuantizedTensor(t.data[start:end].clone(), t.qtype, (end - start, t.shape[1]), t.type_name))
    return nn.Embedding(end - start, embed.embedding_dim, _weight=embed.weight.detach()[start:end].clone())

