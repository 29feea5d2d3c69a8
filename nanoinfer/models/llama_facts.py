"""The facts of the families llama.py runs (registered in models/__init__.py): plain data that
the loaders, the builder and tensor parallelism read through the registry, without this
package's model code. Every one is a pre-norm Llama layer stack, so tensor parallelism's split
rules and the compiled decoder stack both apply."""
from ..registry import Architecture

_MODULE = ".llama:LlamaForCausalLM"
_SHARED = dict(tensor_parallel=True, decoder_stack=True)

LLAMA = Architecture("llama", _MODULE, ("LlamaForCausalLM",), ("llama",), ("llama",), gguf_llama_rope=True, **_SHARED)
# llama.cpp converts Mistral to its "llama" architecture; its name or its sliding window tells it apart.
MISTRAL = Architecture("mistral", _MODULE, ("MistralForCausalLM",), ("mistral",), sliding_window=True,
                       gguf_llama_rope=True, gguf_variant_of="llama", gguf_marks=("attention.sliding_window",),
                       gguf_name_marks=("mistral",), **_SHARED)
QWEN2 = Architecture("qwen2", _MODULE, ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), attention_bias=True, **_SHARED)
QWEN3 = Architecture("qwen3", _MODULE, ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), qk_norm=True, **_SHARED)
SMOLLM3 = Architecture("smollm3", _MODULE, ("SmolLM3ForCausalLM",), ("smollm3",), ("smollm3",), no_rope_step=4,
                       gguf_llama_rope=True, **_SHARED)
# Phi-3 checkpoints hold q/k/v and gate/up fused, as llama.py's module does (llama.cpp: attn_qkv, ffn_up).
PHI3 = Architecture("phi3", _MODULE, ("Phi3ForCausalLM",), ("phi3",), ("phi3",), sliding_window=True, gguf_fused=True,
                    **_SHARED)
