"""Attention backends by name. `register_backend(name, cls)` adds one; `backend_class`
picks the class an engine runs: a name the user gave, or "auto", the first registered
backend whose `supports(device, dtype)` passes. Registration order is auto's preference
order: attention/__init__.py registers the built-in ones, fastest first, with the plain
PyTorch backend (it runs anywhere) last; one registered from outside comes after it, so it
runs when named, never in place of a built-in one."""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from .base import AttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}  # in registration order


def register_backend(name: str, cls: type[AttentionBackend]) -> None:
    if name == "auto" or name in _BACKENDS:
        raise ValueError(f"an attention backend named {name!r} is already registered")
    _BACKENDS[name] = cls


def backend_class(name: str, device: torch.device | str, dtype: torch.dtype) -> type[AttentionBackend]:
    """The backend to build over a KV cache of `dtype` on `device`. A name that is not
    registered, or names a backend that cannot run there, is refused (InvalidRequestError, a
    ValueError): an explicit choice never falls back silently."""
    device = torch.device(device)
    where = f"on {device} with a {str(dtype).removeprefix('torch.')} KV cache"
    if name == "auto":
        for cls in _BACKENDS.values():
            if cls.supports(device, dtype):
                return cls
        raise InvalidRequestError(f"no attention backend runs {where}", "attention_backend")
    if name not in _BACKENDS:
        raise InvalidRequestError(f"attention_backend={name!r} must be one of auto, {', '.join(_BACKENDS)}",
                                  "attention_backend")
    cls = _BACKENDS[name]
    if not cls.supports(device, dtype):
        runs = [n for n, c in _BACKENDS.items() if c.supports(device, dtype)]
        raise InvalidRequestError(f"attention_backend={name!r} cannot run {where} (these can: {', '.join(runs)})",
                                  "attention_backend")
    return cls
