"""nanoinfer: a small, readable LLM inference engine in Python and PyTorch."""
# models first: the built-in families' facts reach the registry by registration
# (models/__init__.py), and every import of a nanoinfer module runs this file first, so a
# loader never sees an empty registry.
from . import models  # noqa: F401
from .engine.outputs import CompletionOutput, FinishCause, RequestOutput, StreamDelta
from .errors import InvalidRequestError, ModelLoadError, NanoinferError
from .llm import LLM
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta", "FinishCause",
           "NanoinferError", "ModelLoadError", "InvalidRequestError"]
__version__ = "0.1.0"
