"""The generation loop at its plainest: no cache, the whole sequence through the model
every step, the last row's logits kept.

This is the reference the fast path is tested against. Each step costs a forward over
the full context, so total work grows with the square of the length (the cube for
attention); `nanoinfer bench loop` measures exactly that.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from .attention import CausalAttention, layer_params
from .engine.outputs import ForwardStat
from .models.batch import ForwardBatch


@torch.inference_mode()
def generate_uncached(model: nn.Module, prompt_ids: list[int], max_tokens: int,
                      eos_ids: frozenset[int] | set[int] = frozenset(),
                      stats: list[ForwardStat] | None = None,
                      kv_dtype: torch.dtype | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding. Returns the generated ids and the logits each step sampled from.
    kv_dtype: k and v rounded to it, as an engine's cache of that dtype stores them."""
    ids = list(prompt_ids)
    out, all_logits = [], []
    device = next(model.parameters()).device
    attention = CausalAttention(layer_params(model.config), kv_dtype) if kv_dtype is not None else None
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        logits = model(ForwardBatch.whole(torch.tensor(ids, device=device), attention=attention))[-1].cpu()
        if stats is not None:
            stats.append(ForwardStat(len(ids), len(ids), time.perf_counter() - t0))
        token = int(torch.argmax(logits))
        all_logits.append(logits)
        out.append(token)
        ids.append(token)
        if token in eos_ids:
            break
    return out, all_logits


def prompt_logprobs_uncached(model: nn.Module, prompt_ids: list[int], kv_dtype: torch.dtype | None = None
                             ) -> list[float]:
    """Each prompt token's log-probability given the tokens before it (the first has none), from
    one uncached forward over the whole prompt: what the engine's prompt_logprobs must equal."""
    device = next(model.parameters()).device
    attention = CausalAttention(layer_params(model.config), kv_dtype) if kv_dtype is not None else None
    with torch.inference_mode():
        logits = model(ForwardBatch.whole(torch.tensor(prompt_ids, device=device), attention=attention)).cpu()
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[i, prompt_ids[i + 1]]) for i in range(len(prompt_ids) - 1)]
