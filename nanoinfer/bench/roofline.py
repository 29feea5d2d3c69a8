"""What a forward must move and compute: the yardsticks the benchmarks measure against.

Decode reads every weight once per step whatever the batch, plus each sequence's KV
cache, and does about 2 FLOPs per weight per sequence. So small batches are bound by
memory bandwidth, and a batch turns compute-bound only once B x FLOPs / peak FLOP/s
overtakes bytes / peak bandwidth.

Bytes here are the bytes a good engine must move: the weights as served (the tensors
the engine holds, in their dtype), only the embedding rows a batch looks up (a tied
table is read whole anyway, as the LM head), only the routed experts a step's tokens
choose (a mixture of experts: top_k of num_experts per token), and each layer's KV cache
within its window. nanochat's MBU counts whole embedding tables and fp32 weights; that overstates
the traffic, so these figures are not comparable one to one.

All functions are pure: a ModelConfig and (name, tensor) pairs in, integers out. Meta
tensors work, so tests can account for a model without allocating it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import kv_cache
from ..config import ModelConfig
from ..engine.core import kv_cache_dtype


# --- weights -------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    embedding: int  # lookup tables: the token embedding when untied (a tied one counts as lm_head),
    #                 and nanochat's value embeddings, which are lookups too
    embedding_row: int  # what one token's lookups read: a row of each untied table
    lm_head: int
    body: int  # everything else: the layers' matmuls, norms, biases, gates, the final norm
    experts: int = 0  # a mixture of experts' routed experts, all of them (a step reads those chosen)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.body + self.experts


def served_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as the engine holds them: parameters (a tied table once) and
    persistent buffers (a quantised linear may keep packed weights there), but not
    derived buffers such as the rotary tables."""
    persistent = set(model.state_dict(keep_vars=True))
    out = list(model.named_parameters())  # named_parameters() drops the tied duplicate
    out += [(n, b) for n, b in model.named_buffers() if n in persistent]
    # Weights kept in a file's block format live in buffers of modules that say so; a tied
    # head's blocks are the token table's, counted once.
    seen = {t.data_ptr() for _, t in out}
    for prefix, m in model.named_modules():
        if getattr(m, "holds_weights", False):
            for name, b in m.named_buffers(recurse=False):
                if b is not None and b.data_ptr() not in seen:
                    seen.add(b.data_ptr())
                    out.append((f"{prefix}.{name}", b))
    return out


def _is_token_table(name: str) -> bool:
    return "embed_tokens" in name or name.split(".")[-2:-1] == ["wte"]


def weight_bytes(tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> WeightBytes:
    """Classify bytes by tensor name (Hugging Face / nanochat names, which the loaders keep)."""
    embedding = lm_head = body = row = experts = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if ".mlp.experts." in name:
            experts += n
        elif _is_token_table(name) and tied:
            lm_head += n  # read whole every step as the LM head; the lookups come free
        elif _is_token_table(name) or name.startswith("value_embeds."):
            embedding += n
            row += n // t.shape[0]
        elif name.startswith("lm_head"):
            lm_head += n
        else:
            body += n
    return WeightBytes(embedding, row, lm_head, body, experts)


def model_weight_bytes(model: nn.Module, config: ModelConfig) -> WeightBytes:
    return weight_bytes(served_tensors(model), config.tie_word_embeddings)


# --- per-token constants -------------------------------------------------------------
def layer_windows(config: ModelConfig) -> list[int | None]:
    windows = getattr(config, "windows", None)
    return windows() if callable(windows) else [config.sliding_window] * config.num_layers


def matmul_params(config: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: q, k, v, o and the MLP per layer,
    and the LM head (tied or not, its matmul happens). The MLP has three matrices in the
    Llama family (gated SiLU) and two in nanochat (relu squared). nanochat's tiny gates
    (value-embedding and smear, 12-24 inputs) are left out: well under 0.1%."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    mlp_matrices = 2 if config.architecture == "nanochat" else 3
    total = lm_head_params(config)
    for layer in range(config.num_layers):
        total += h * q + 2 * h * kv + q * h
        if config.sparse(layer):  # a token runs its top_k experts, the shared one and the router
            moe = config.moe
            total += 3 * h * (moe.top_k * moe.intermediate_size + (moe.shared_intermediate_size or 0))
            total += h * moe.num_experts + (h if moe.shared_intermediate_size else 0)
        else:
            total += mlp_matrices * h * config.intermediate_size
    return total


def expert_fraction(config: ModelConfig, tokens: int) -> float:
    """The share of a layer's routed experts that `tokens` tokens read, if each token picks its
    top_k uniformly: 1 - (1 - k/E)^tokens (k/E at batch 1; near 1 once batches are large).
    Real routers are not uniform; a measured step reads this many or fewer."""
    moe = config.moe
    if moe is None or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens


def lm_head_params(config: ModelConfig) -> int:
    # nanochat pads the vocab to a multiple of 64 and computes logits over all of it
    return config.hidden_size * int(config.extra.get("padded_vocab", config.vocab_size))


def _keys_seen(context: int, window: int | None) -> int:
    return context if window is None else min(context, window)


def kv_bytes_read(config: ModelConfig, context: int, dtype_bytes: float) -> int:
    """KV bytes one sequence's decode step reads when it attends over `context` keys:
    each layer reads only the keys inside its window."""
    per_key = 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    return round(sum(per_key * _keys_seen(context, w) for w in layer_windows(config)))


def attention_flops_per_key(config: ModelConfig) -> int:
    """q.k and p.v: 2 FLOPs each per query head per head dim."""
    return 4 * config.num_heads * config.head_dim


def decode_flops_per_token(config: ModelConfig, context: int) -> int:
    """One decoded token attending over `context` keys (itself included)."""
    attn = attention_flops_per_key(config) * sum(_keys_seen(context, w) for w in layer_windows(config))
    return 2 * matmul_params(config) + attn


def _sum_keys(first: int, last: int, window: int | None) -> int:
    """Sum of min(c, window) for c in first..last: the keys a run of causal queries sees."""
    if last < first:
        return 0
    if window is None or last <= window:
        return (first + last) * (last - first + 1) // 2
    if first > window:
        return (last - first + 1) * window
    return (first + window) * (window - first + 1) // 2 + (last - window) * window


def prefill_flops(config: ModelConfig, num_tokens: int, past: int = 0, logits_rows: int = 1) -> int:
    """One sequence prefilling `num_tokens` after `past` cached ones. The query at position
    past + i (i from 1) sees min(past + i, window) keys: the causal average, summed exactly.
    The LM head runs only for the rows that sample (the engine computes the last one only)."""
    body = matmul_params(config) - lm_head_params(config)
    attn = sum(_sum_keys(past + 1, past + num_tokens, w) for w in layer_windows(config))
    return 2 * body * num_tokens + 2 * lm_head_params(config) * logits_rows + attention_flops_per_key(config) * attn


# --- the roofline of one model as served ----------------------------------------------
@dataclass(frozen=True)
class Roofline:
    config: ModelConfig
    weights: WeightBytes
    kv_dtype_bytes: float  # bytes per value of the KV cache's format (kv_cache_dtype; q8_0: 34 / 32)

    @classmethod
    def for_model(cls, model: nn.Module, config: ModelConfig, kv_dtype: str = "auto") -> Roofline:
        return cls(config, model_weight_bytes(model, config), kv_cache.value_bytes(kv_cache_dtype(model, kv_dtype)))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(self.kv_dtype_bytes)

    def fixed_step_bytes(self, tokens: int = 1) -> int:
        """Read once per step: the body, the LM head and the experts `tokens` tokens choose
        (every weight but those, whatever the batch)."""
        experts = round(self.weights.experts * expert_fraction(self.config, tokens))
        return self.weights.body + self.weights.lm_head + experts

    def per_seq_step_bytes(self, context: int) -> int:
        """Read per sequence in a decode step: its lookup rows and its KV."""
        return self.weights.embedding_row + kv_bytes_read(self.config, context, self.kv_dtype_bytes)

    def decode_step_bytes(self, batch: int, context: int) -> int:
        return self.fixed_step_bytes(batch) + batch * self.per_seq_step_bytes(context)

    def decode_step_flops(self, batch: int, context: int) -> int:
        return batch * decode_flops_per_token(self.config, context)

    def prefill_bytes(self, batch: int, num_tokens: int) -> int:
        """Weights once, each prompt token's lookup rows, and the KV it writes."""
        return (self.fixed_step_bytes(batch * num_tokens)
                + batch * num_tokens * (self.weights.embedding_row + self.kv_bytes_per_token))

    def prefill_flops(self, batch: int, num_tokens: int) -> int:
        return batch * prefill_flops(self.config, num_tokens)

    def batch1_ceiling(self, peak_bandwidth: float, context: int) -> float:
        """Tokens/s of batch-1 decode if every byte moved at peak bandwidth."""
        return peak_bandwidth / self.decode_step_bytes(1, context)

    def compute_bound_batch(self, peak_flops: float, peak_bandwidth: float, context: int) -> float | None:
        """The batch B where B * flops/peak_flops = bytes(B)/peak_bw, i.e.
        B = (fixed/bw) / (flops/peak_flops - per_seq/bw). None when KV traffic grows as fast
        as compute (long contexts): decode then never turns compute-bound."""
        denom = decode_flops_per_token(self.config, context) / peak_flops - self.per_seq_step_bytes(context) / peak_bandwidth
        if denom <= 0:
            return None
        return self.fixed_step_bytes(1) / peak_bandwidth / denom

    def card(self, context: int, peak_flops: float, peak_bandwidth: float) -> dict:
        """The static figures, as printed before a latency run."""
        return {
            "weight_bytes": self.weights.total,
            "weight_bytes_detail": {"body": self.weights.body, "lm_head": self.weights.lm_head,
                                    "embedding": self.weights.embedding,
                                    "routed_experts": self.weights.experts,
                                    "routed_experts_read_batch1": self.fixed_step_bytes(1) - self.fixed_step_bytes(0),
                                    "lookup_bytes_per_token": self.weights.embedding_row,
                                    "tied": self.config.tie_word_embeddings},
            "matmul_params": matmul_params(self.config),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "context": context,
            "kv_bytes_read_per_seq": kv_bytes_read(self.config, context, self.kv_dtype_bytes),
            "decode_bytes_batch1": self.decode_step_bytes(1, context),
            "decode_flops_per_token": decode_flops_per_token(self.config, context),
            "batch1_ceiling_tok_s": self.batch1_ceiling(peak_bandwidth, context),
            "compute_bound_batch": self.compute_bound_batch(peak_flops, peak_bandwidth, context),
        }
