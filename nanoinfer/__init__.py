"""nanoinfer: a small, readable LLM inference engine in Python and PyTorch."""
from .engine.outputs import CompletionOutput, FinishCause, RequestOutput, StreamDelta
from .errors import InvalidRequestError, ModelLoadError, NanoinferError
from .llm import LLM
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta", "FinishCause",
           "NanoinferError", "ModelLoadError", "InvalidRequestError"]
__version__ = "0.1.0"
