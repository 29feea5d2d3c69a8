"""The model families nanoinfer ships. A module runs one family or several; each family's facts
(its names in every format, config adapter, config keys and tensors of its own, whether tensor
parallelism and the compiled decoder stack apply) are one registry.Architecture declared beside
the module, in <module>_facts.py. The registrations below are the registry's entries, in lookup
order; they run when anything in nanoinfer.models is imported, which `import nanoinfer` does. A
family from outside the package registers the same way (docs/architecture.md, "How to add an
architecture")."""
from ..registry import register
from .gemma_facts import GEMMA2, GEMMA3
from .llama_facts import LLAMA, MISTRAL, PHI3, QWEN2, QWEN3, SMOLLM3
from .moe_facts import MIXTRAL, QWEN2MOE, QWEN3MOE
from .nanochat_facts import NANOCHAT
from .olmo2_facts import OLMO2

for _family in (LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3, PHI3, OLMO2, GEMMA2, GEMMA3, QWEN2MOE, QWEN3MOE, MIXTRAL,
                NANOCHAT):
    register(_family)
