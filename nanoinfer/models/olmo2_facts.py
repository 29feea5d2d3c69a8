"""OLMo 2's facts (olmo2.py runs it): post-norm layers with q/k norms over all heads. Tensor
parallelism splits it (the q/k norm's sum of squares is all-reduced); the compiled decoder stack
runs its layers."""
from ..registry import Architecture

OLMO2 = Architecture("olmo2", ".olmo2:Olmo2ForCausalLM", ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",), qk_norm=True,
                     qk_norm_over_heads=True, norm_layout="post", tensor_parallel=True,
                     decoder_stack=True)
