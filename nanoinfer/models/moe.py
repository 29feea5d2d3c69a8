"""Mixtures of experts: Qwen2-MoE, Qwen3-MoE and Mixtral. llama.py's attention and pre-norm
layers (Qwen2-MoE's q/k/v bias, Qwen3-MoE's q/k norms are its flags); in place of the MLP,
a router and num_experts small gated MLPs (ModelConfig.moe):

- the router's logits -> softmax (fp32) -> each token's top_k experts and weights,
  renormalised to sum 1 where the family does (Mixtral, Qwen3-MoE's files say so);
- the tokens grouped by expert: each chosen expert runs once per step on all of its
  tokens, so its weights are read once however many tokens chose it (in a GGUF's block
  format they run on the quantised kernels, like any linear);
- each token's outputs summed in expert order (as transformers does), its weights applied;
- Qwen2-MoE adds a shared expert every token goes through, gated by sigmoid(shared_expert_gate(x)).

With every expert in GGUF blocks on the CPU (fp32 activations), the routed experts run as one
compiled call (kernels/routed_experts.py: the same steps, its router an fp32 dot of its own),
which the decoder stack runs too; otherwise the PyTorch loop below.

A token's result depends only on the token: which other tokens share its experts changes
how many rows an expert's matmul has, and the linears give each row the same bits whatever
the rows around it.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels import routed_experts
from ..kernels.cpu_linear import PackedLinear
from ..kernels.quant_linear import QuantLinear
from .llama import MLP, DecoderLayer, LlamaForCausalLM

# Mixtral's checkpoint names (block_sparse_moe, w1 gate, w3 up, w2 down) -> the Qwen names used here
_MIXTRAL = [(".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")]
# transformers 5 in memory (and files saved from it unconverted): all experts in one 3-D tensor
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, intermediate_size=moe.intermediate_size)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(config, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts [T, k] and their weights [T, k] (x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def compiled(self) -> routed_experts.RoutedExperts | None:
        """The routed experts as the compiled layer, built on first use, or None where it
        cannot run them (an expert not in GGUF blocks with a kernel, a router not fp32 on the CPU)."""
        if "_compiled" not in self.__dict__:
            self.__dict__["_compiled"] = self._build_compiled()
        return self.__dict__["_compiled"]

    def _build_compiled(self) -> routed_experts.RoutedExperts | None:
        linears = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        if not all(isinstance(gu, QuantLinear) and len(gu.parts) == 2 and isinstance(d, QuantLinear)
                   and len(d.parts) == 1 and gu.bias is None and d.bias is None for gu, d in linears):
            return None
        projections = [[(gu.parts[i].qtype, getattr(gu, f"part{i}"), gu.parts[i].repacked) for gu, _ in linears]
                       for i in (0, 1)]
        projections.append([(d.parts[0].qtype, d.part0, d.parts[0].repacked) for _, d in linears])
        if isinstance(self.gate, PackedLinear):  # (an fp32 router in the packed GEMM's panels)
            router = self.gate.dense_weight()
        elif isinstance(self.gate, nn.Linear):
            router = self.gate.weight.detach()
        else:
            return None
        if self.gate.bias is not None or not routed_experts.supported(router, projections):
            return None
        as_weights = [routed_experts.ExpertWeights(p[0][0], p[0][2], [w for _, w, _ in p]) for p in projections]
        return routed_experts.RoutedExperts(router.contiguous(), *as_weights, top_k=self.top_k,
                                            norm_topk=self.norm_topk_prob,
                                            inter=self.experts[0].down_proj.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.compiled() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        if layer is not None:
            out = layer(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        else:
            out = self._experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        choices = experts.flatten()  # row r's j-th choice at r * top_k + j
        order = torch.argsort(choices, stable=True)
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start:start + n]
            start += n
            rows = picks // self.top_k
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights.view(-1)[picks].unsqueeze(1))
        return out


class MoeDecoderLayer(DecoderLayer):
    stack_layer = True  # Llama's layer with the MLP swapped: the compiled stack runs it (feature "experts")

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        if config.sparse(layer):  # (Qwen's mlp_only_layers keep the dense MLP)
            self.mlp = SparseMoeBlock(config)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        renamed = {}
        for name, t in state.items():
            if ".block_sparse_moe." in name:
                for old, new in _MIXTRAL:
                    name = name.replace(old, new)
            if m := _STACKED.fullmatch(name):
                for e, part in enumerate(t.unbind(0)):
                    renamed[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = part
                continue
            renamed[name] = t
        super().load_weights(renamed)
