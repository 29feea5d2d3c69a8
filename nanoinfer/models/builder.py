"""Files -> a module ready to serve: a loader reads the files, the registry names the
module for their architecture, and the module takes the tensors as they are. The one place
where loaders and model modules meet (the import-linter contract keeps every other module of
this package off the loaders)."""
from __future__ import annotations

import importlib
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import registry
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..kernels.cpu_linear import adapt_linears
from ..kernels.quant_linear import kernel_gap
from ..kernels.weight_memory import return_freed_heap
from ..loaders import load_files
from ..loaders.gguf import dequantize
from ..tensors import QuantizedTensor
from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    format: str  # "gguf" | "hf" | "nanochat"
    load_seconds: float
    info: dict = field(default_factory=dict)  # loader notes (nanochat: era, step, tag, ...)
    source: dict = field(default_factory=dict)  # how it was loaded (path, dtype, overrides): what another rank reloads


def model_class(architecture: str) -> type[nn.Module]:
    module, cls = registry.by_name(architecture).model.split(":")
    return getattr(importlib.import_module(module, package=__package__), cls)


def load_model(path: str | Path | None = None, dtype: torch.dtype | None = torch.float32,
               device: str | torch.device = "cpu", overrides: dict | None = None,
               transform: Callable[[nn.Module, ModelConfig], nn.Module] | None = None) -> LoadedModel:
    """dtype None ("auto"): a GGUF's tensors as stored, each run by the kernel for its block
    format (a type without one is dequantised at load, with a line per format and reason); other formats
    in float32. overrides: for nanochat checkpoints (see loaders.load_files). transform: applied
    to the built module (a tensor-parallel rank keeps its share)."""
    t0 = time.perf_counter()
    files = load_files(path, dtype, overrides)
    files.info["tensor_formats"] = _settle_formats(files.state)
    return_freed_heap()
    model = build_module(files.config, files.state, device, str(files.path))
    if transform is not None:
        model = transform(model, files.config)
    if files.release is not None:  # the repacked weights are copies: the file's pages they came from are not needed
        files.release()
    return LoadedModel(model, files.tokenizer, files.config, files.path, files.format, time.perf_counter() - t0,
                       files.info, {"path": str(files.path), "dtype": dtype, "overrides": overrides})


def _settle_formats(state: dict) -> dict[str, int]:
    """Dequantise the block-format tensors no kernel runs, with a line per format and reason;
    count the tensors of each format."""
    formats: Counter[str] = Counter()
    dequantised: dict[tuple[str, str], list[str]] = {}
    for name, t in state.items():
        if isinstance(t, QuantizedTensor) and (gap := kernel_gap(t)) is not None:
            dequantised.setdefault((t.type_name, gap), []).append(f"{name} [{t.shape[0]}, {t.shape[1]}]")
            state[name] = t = dequantize(t)
        formats[t.type_name if isinstance(t, QuantizedTensor) else str(t.dtype).removeprefix("torch.")] += 1
    for (type_name, gap), names in dequantised.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        print(f"nanoinfer: {len(names)} {type_name} tensor(s) dequantised to float32 at load ({gap}): "
              f"{', '.join(names[:3])}{more}", file=sys.stderr)
    return dict(formats)


def build_module(config: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 where: str = "the weights") -> nn.Module:
    """Build on the meta device and take the loaders' tensors as they are (already in the
    serving dtype: no copy, no second cast), then make the rotary tables on `device`.
    Empties `state`: tensors the model did not keep as they are (fused projections copy
    theirs) are freed before the linears are packed, which copies them once more."""
    family = registry.by_name(config.architecture)
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    model.use_decoder_stack = family.decoder_stack  # a fast path only where the family's facts allow it
    try:
        model.load_weights(state)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{where}: {' '.join(str(e).split())}") from None
    state.clear()
    model.reset_rope()  # the meta-device tables become real tensors
    model = model.to(device).eval()
    adapt_linears(model)  # CPU: weights packed once (bf16 for oneDNN, fp32 for the compiled GEMM)
    return model
