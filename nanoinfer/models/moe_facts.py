"""The facts of the mixtures of experts moe.py runs: llama.py's attention, routed experts for the
MLP (the loaders read ModelConfig.moe for them). Tensor parallelism splits every expert; the
compiled decoder stack runs the routed experts (not Qwen2-MoE's shared expert: its capability
check keeps those layers on the modules)."""
from ..registry import Architecture

_MODULE = ".moe:MoeForCausalLM"

QWEN2MOE = Architecture("qwen2moe", _MODULE, ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",),
                        attention_bias=True, experts=True, tensor_parallel=True, decoder_stack=True)
QWEN3MOE = Architecture("qwen3moe", _MODULE, ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",), qk_norm=True,
                        experts=True, gguf_moe_norm_topk=True, tensor_parallel=True,
                        decoder_stack=True)
# llama.cpp converts Mixtral to its "llama" architecture with expert tensors.
MIXTRAL = Architecture("mixtral", _MODULE, ("MixtralForCausalLM",), ("mixtral",), sliding_window=True,
                       gguf_llama_rope=True, gguf_variant_of="llama", gguf_marks=("expert_count",), experts=True,
                       moe_norm_topk=True, gguf_moe_norm_topk=True, tensor_parallel=True,
                       decoder_stack=True)
