"""Every architecture nanoinfer serves, in one list: the names each file format gives it,
the facts a file may leave unstated (the config adapter), and the module that runs it.

Data only. Loaders read it to recognise a file and finish its ModelConfig, without
importing any model code; the model builder (models/builder.py) imports the class an
entry names when it builds the module. Adding a family is one model file and one entry
here (docs/architecture.md, "How to add an architecture").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import ModelLoadError


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture
    model: str  # "module:Class", relative to nanoinfer.models when it starts with ".", imported when built
    hf_classes: tuple[str, ...] = ()  # config.json "architectures"
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type", for configs without "architectures"
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture
    checkpoint_format: str | None = None  # a file format of its own (loaders/<format>.py)
    # The config adapter: facts of the family that a file may not state.
    attention_bias: bool = False  # q/k/v projections carry a bias
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary
    sliding_window: bool = False  # config.json's sliding_window applies without use_sliding_window
    # Every n-th layer has no rotary (SmolLM3's NoPE layers: 4, which llama.cpp hard-codes: a
    # GGUF states no key for it); a config.json's own no_rope_layers list takes precedence.
    no_rope_step: int | None = None
    # llama.cpp's converter stores q and k rows in its llama rope order (pairs interleaved in
    # each head) for these families; the loader puts them back in Hugging Face's order.
    gguf_llama_rope: bool = False
    qk_norm_over_heads: bool = False  # q/k RMSNorm over all heads at once, not per head
    norm_layout: str = "pre"  # ModelConfig.norm_layout
    # Every n-th layer attends fully, the others within the sliding window (Gemma 3: 6, which
    # llama.cpp hard-codes); a config.json's layer_types takes precedence.
    swa_pattern: int | None = None
    gguf_fused: bool = False  # a GGUF holds q/k/v as one attn_qkv and gate/up as one ffn_up (llama.cpp's phi3)
    rope_theta_local: float | None = None  # the sliding layers' rotary base when a file does not say
    # Mixture of experts: whether the top-k routing weights are renormalised to sum 1. A
    # family that always does (Mixtral) says True; None: config.json's norm_topk_prob decides
    # (transformers' default False). A GGUF states it only in newer files (expert_weights_norm);
    # otherwise llama.cpp's fixed choice for the architecture holds, gguf_moe_norm_topk.
    moe_norm_topk: bool | None = None
    gguf_moe_norm_topk: bool = False
    # config.json fields a family's transformers config class defaults, for configs that list
    # only what differs (the text_config of Gemma 3's multimodal checkpoints)
    hf_defaults: dict = field(default_factory=dict, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.model.startswith(".moe:")

    def adapt(self, config: ModelConfig) -> ModelConfig:
        config.architecture = self.name
        config.attention_bias = config.attention_bias or self.attention_bias
        config.qk_norm = config.qk_norm or self.qk_norm
        config.qk_norm_over_heads = self.qk_norm_over_heads
        config.norm_layout = self.norm_layout
        if self.swa_pattern and config.sliding_window and config.layer_windows is None:
            p = self.swa_pattern
            config.layer_windows = [None if i % p == p - 1 else config.sliding_window for i in range(config.num_layers)]
        if config.rope_theta_local is None:
            config.rope_theta_local = self.rope_theta_local
        if self.no_rope_step and config.rope_layers is None:
            config.rope_layers = [(i + 1) % self.no_rope_step != 0 for i in range(config.num_layers)]
        return config


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ".llama:LlamaForCausalLM", ("LlamaForCausalLM",), ("llama",), ("llama",),
                 gguf_llama_rope=True),
    # llama.cpp converts Mistral to its "llama" architecture; the GGUF loader tells them apart by name.
    Architecture("mistral", ".llama:LlamaForCausalLM", ("MistralForCausalLM",), ("mistral",), sliding_window=True,
                 gguf_llama_rope=True),
    Architecture("qwen2", ".llama:LlamaForCausalLM", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",),
                 attention_bias=True),
    Architecture("qwen3", ".llama:LlamaForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), qk_norm=True),
    Architecture("smollm3", ".llama:LlamaForCausalLM", ("SmolLM3ForCausalLM",), ("smollm3",), ("smollm3",),
                 no_rope_step=4, gguf_llama_rope=True),
    # Phi-3 checkpoints hold q/k/v and gate/up fused, as llama.py's module does (llama.cpp: attn_qkv, ffn_up).
    Architecture("phi3", ".llama:LlamaForCausalLM", ("Phi3ForCausalLM",), ("phi3",), ("phi3",), sliding_window=True,
                 gguf_fused=True),
    Architecture("olmo2", ".olmo2:Olmo2ForCausalLM", ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",), qk_norm=True,
                 qk_norm_over_heads=True, norm_layout="post"),
    Architecture("gemma2", ".gemma:GemmaForCausalLM", ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",),
                 norm_layout="sandwich", swa_pattern=2),
    # (Gemma3ForConditionalGeneration: the text part of the multimodal checkpoints; loaders/hf.py unwraps it)
    Architecture("gemma3", ".gemma:GemmaForCausalLM", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                 ("gemma3_text",), ("gemma3",), qk_norm=True, norm_layout="sandwich", swa_pattern=6,
                 rope_theta_local=10000.0,
                 hf_defaults={"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                              "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1000000.0,
                              "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    # Mixtures of experts: llama.py's attention, models/moe.py's routed experts.
    Architecture("qwen2moe", ".moe:MoeForCausalLM", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",),
                 attention_bias=True),
    Architecture("qwen3moe", ".moe:MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",),
                 qk_norm=True, gguf_moe_norm_topk=True),
    # llama.cpp converts Mixtral to its "llama" architecture with expert tensors; the GGUF loader tells them apart.
    Architecture("mixtral", ".moe:MoeForCausalLM", ("MixtralForCausalLM",), ("mixtral",), sliding_window=True,
                 gguf_llama_rope=True, moe_norm_topk=True, gguf_moe_norm_topk=True),
    Architecture("nanochat", ".nanochat:NanochatGPT", checkpoint_format="nanochat"),
)


def by_name(name: str) -> Architecture:
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise ModelLoadError(f"no architecture named {name!r} (known: {', '.join(a.name for a in ARCHITECTURES)})")


def for_hf(classes: list[str] | None, model_type: str | None) -> Architecture:
    """The entry for a config.json: its `architectures` first, else its `model_type`, as transformers does."""
    if classes:
        found = next((a for name in classes for a in ARCHITECTURES if name in a.hf_classes), None)
        if found is None:
            raise ModelLoadError(f"unsupported architecture {classes!r:.80}; supported: "
                                 f"{', '.join(c for a in ARCHITECTURES for c in a.hf_classes)}")
        return found
    if model_type is None:
        raise ModelLoadError("neither architectures nor model_type is given")
    found = next((a for a in ARCHITECTURES if model_type in a.hf_model_types), None)
    if found is None:
        raise ModelLoadError(f"unsupported model_type {model_type!r:.60} (no architectures given); supported: "
                             f"{', '.join(t for a in ARCHITECTURES for t in a.hf_model_types)}")
    return found


def for_gguf(name: object) -> Architecture:
    found = next((a for a in ARCHITECTURES if name in a.gguf_names), None)
    if found is None:
        raise ModelLoadError(f"unsupported GGUF architecture {name!r:.60} (supported: "
                             f"{', '.join(n for a in ARCHITECTURES for n in a.gguf_names)})")
    return found
