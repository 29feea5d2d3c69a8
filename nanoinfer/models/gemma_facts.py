"""The facts of Gemma 2 and Gemma 3 (gemma.py runs them): sandwich norms, sliding and full layers.
Tensor parallelism splits them; the compiled decoder stack does not run them (pre-norm only)."""
from ..registry import Architecture

_MODULE = ".gemma:GemmaForCausalLM"

GEMMA2 = Architecture("gemma2", _MODULE, ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",), norm_layout="sandwich",
                      swa_pattern=2, tensor_parallel=True, decoder_stack=True)
# (Gemma3ForConditionalGeneration: the text part of the multimodal checkpoints; loaders/hf.py unwraps it)
GEMMA3 = Architecture("gemma3", _MODULE, ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text",),
                      ("gemma3",), qk_norm=True, norm_layout="sandwich", swa_pattern=6, rope_theta_local=10000.0,
                      hf_defaults={"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                                   "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                                   "rope_theta": 1000000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                                   "tie_word_embeddings": True},
                      tensor_parallel=True, decoder_stack=True)
