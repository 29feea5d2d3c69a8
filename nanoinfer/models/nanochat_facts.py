"""nanochat's facts (nanochat.py runs it): a checkpoint format of its own (loaders/nanochat.py
writes its era constants into config.extra), no Hugging Face or GGUF names, and neither tensor
parallelism nor the compiled decoder stack."""
from ..registry import Architecture

NANOCHAT = Architecture("nanochat", ".nanochat:NanochatGPT", checkpoint_format="nanochat")
