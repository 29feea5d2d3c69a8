"""A mixture-of-experts layer's routed experts as one compiled call (csrc/routed_experts.cpp):
the fp32 router, each row's top_k experts, one multi-row GEMM per chosen expert on its
gathered rows (every expert's weights in their GGUF blocks), silu(gate) * up, down, and the
weighted sum in expert order. The decoder stack runs the same C++ body inside its team, so a
model's layers give the same bits stacked or one by one.

This module knows weights only; models/moe.py maps a SparseMoeBlock onto it."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_kernels, quant

_p, _i = ctypes.c_void_p, ctypes.c_int64


class RoutedExpertsStruct(ctypes.Structure):  # csrc/routed_experts.cpp: RoutedExperts
    _fields_ = [("num_experts", _i), ("top_k", _i), ("norm_topk", _i), ("hidden", _i), ("inter", _i),
                ("router", _p), ("qtype", _i * 3), ("repacked", _i * 3), ("w", _p * 3)]


@dataclass
class ExpertWeights:
    """One projection of every expert (gate, up or down): one GGML type and layout for all."""
    qtype: int
    repacked: bool
    weights: list[torch.Tensor]  # uint8 [rows, row_bytes], one per expert


class RoutedExperts:
    """The layer's weights, fixed at construction (the tensors must outlive it)."""

    def __init__(self, router: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights,
                 top_k: int, norm_topk: bool, inter: int):
        num_experts, hidden = router.shape
        assert router.dtype == torch.float32 and router.is_contiguous()
        self.router, self.projections = router, (gate, up, down)  # keeps every tensor alive
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        pointers = [(ctypes.c_void_p * num_experts)(*(w.data_ptr() for w in p.weights)) for p in self.projections]
        self._pointers = pointers
        self.struct = RoutedExpertsStruct(
            num_experts, top_k, int(norm_topk), hidden, inter, router.data_ptr(),
            (_i * 3)(*(p.qtype for p in self.projections)), (_i * 3)(*(int(p.repacked) for p in self.projections)),
            (_p * 3)(*(ctypes.cast(a, ctypes.c_void_p) for a in pointers)))
        self._ref = ctypes.byref(self.struct)

    def __call__(self, x: torch.Tensor, with_routes: bool = False):
        """x [T, hidden] -> the experts' weighted sum [T, hidden] (fp32); with_routes: also each
        row's experts [T, top_k] (in expert order, int32) and their weights."""
        x = x.float().contiguous()
        T = x.shape[0]
        out = torch.empty_like(x)
        choices = torch.empty(T, self.top_k, dtype=torch.int32) if with_routes else None
        weights = torch.empty(T, self.top_k) if with_routes else None
        rc = cpu_kernels.library().routed_experts(
            self._ref, quant.current_path(), x.data_ptr(), T, out.data_ptr(),
            choices.data_ptr() if with_routes else None, weights.data_ptr() if with_routes else None)
        if rc == 1:
            raise ValueError("routed experts: malformed layer")
        if rc:
            raise RuntimeError(f"routed experts: quant_linear failed ({quant.error_message(rc)})")
        return (out, choices, weights) if with_routes else out


def supported(router: torch.Tensor, projections: list[list[tuple[int, torch.Tensor, bool]]]) -> bool:
    """Whether the compiled layer can run these weights: the library built, an fp32 router,
    and for each projection (gate, up, down) every expert's in one kernel type and layout."""
    if cpu_kernels.library() is None or router.dtype != torch.float32 or router.device.type != "cpu":
        return False
    for experts in projections:
        kinds = {(q, r) for q, _, r in experts}
        if len(kinds) != 1 or not quant.supported(next(iter(kinds))[0]):
            return False
    return True
