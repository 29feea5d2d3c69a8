"""The architecture registry: every family nanoinfer serves, as a record of facts (data only),
and the lookups the loaders and the builder make through it.

A family's record (Architecture) says everything the rest of the engine needs to know about
it: the names each file format gives it, the facts a file may leave unstated (the config
adapter), the config keys and tensors of its own, whether tensor parallelism's split rules and
the compiled decoder stack apply, and the module that runs it ("module:Class", imported only
when a model is built). The records are declared beside the model modules
(nanoinfer/models/*_facts.py) and registered there (nanoinfer/models/__init__.py: one
`register` per family); a family from outside the package registers the same way. This module
is the bottom of the stack: loaders read the records to recognise a file, finish its
ModelConfig and name its tensors, without importing any model code; sharding and the builder
read them too, so no second list of families exists anywhere (docs/architecture.md, "How to
add an architecture").
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import ModelConfig, check_finite, check_int
from .errors import ModelLoadError


@dataclass(frozen=True)
class ConfigKey:
    """A fact of the family's own that ModelConfig has no field for. The loaders read it from
    config.json (key `hf`) or from GGUF metadata (`{arch}.{gguf}`), check it, and put it in
    `config.extra[name]`, where the module finds it whatever the format."""
    name: str
    hf: str | None = None  # config.json's key; None: `name`
    gguf: str | None = None  # GGUF metadata key after "{arch}."; None: `name`
    kind: type = float  # float (finite), int (0 .. 2^31-1) or bool
    default: float | int | bool | None = None  # when a file does not state it; None: the file must

    def from_hf(self, raw: dict) -> float | int | bool:
        """Its value in a config.json."""
        return self.read(raw.get(self.hf or self.name), self.hf or self.name)

    def from_gguf(self, meta: Mapping[str, Any], arch: str) -> float | int | bool:
        """Its value in a GGUF file's metadata, under "{arch}."."""
        spelled = f"{arch}.{self.gguf or self.name}"
        return self.read(meta.get(spelled), spelled)

    def read(self, value: Any, spelled: str) -> float | int | bool:
        """`value` as the file gives it (None: absent), `spelled` the key as the file spells it."""
        if value is None:
            if self.default is None:
                raise ModelLoadError(f"missing field {spelled!r}")
            return self.default
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ModelLoadError(f"{spelled} must be true or false, got {value!r:.40}")
            return value
        if self.kind is int:
            return check_int(value, spelled, lo=0)
        return check_finite(value, spelled)


@dataclass(frozen=True)
class FamilyTensor:
    """A tensor of the family's own, beyond the common layout every loader knows: the name the
    module loads it under, the name a GGUF file gives it (llama.cpp's; None: HF folders only),
    "{layer}" standing for the layer index in both, and its shape as ModelConfig fields (or
    numbers). The loaders check its shape against the config before anything is read, and the
    GGUF loader renames it."""
    name: str  # e.g. "model.layers.{layer}.my_gain.weight"
    shape: tuple[str | int, ...]  # e.g. ("hidden_size",)
    gguf: str | None = None  # e.g. "blk.{layer}.my_gain.weight"

    def dims(self, config: ModelConfig) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else getattr(config, d) for d in self.shape)

    def names(self, config: ModelConfig) -> list[tuple[str, str | None]]:
        """(module name, GGUF name) of each instance: one per layer, or the one."""
        if "{layer}" not in self.name:
            return [(self.name, self.gguf)]
        return [(self.name.format(layer=i), self.gguf and self.gguf.format(layer=i)) for i in range(config.num_layers)]


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture
    model: str  # "module:Class", relative to nanoinfer.models when it starts with ".", imported when built
    hf_classes: tuple[str, ...] = ()  # config.json "architectures"
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type", for configs without "architectures"
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture
    checkpoint_format: str | None = None  # a file format of its own (loaders/<format>.py)
    # llama.cpp writes some families under another's GGUF name (Mistral and Mixtral as "llama"): the
    # file is this family's when it has experts exactly if the family does, and one of its marks:
    # a metadata key present (after "{arch}.") or a word in general.name / general.basename.
    gguf_variant_of: str | None = None
    gguf_marks: tuple[str, ...] = ()
    gguf_name_marks: tuple[str, ...] = ()
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
    experts: bool = False  # the MLP is a mixture of experts: the loaders read ModelConfig.moe
    # Mixture of experts: whether the top-k routing weights are renormalised to sum 1. A
    # family that always does (Mixtral) says True; None: config.json's norm_topk_prob decides
    # (transformers' default False). A GGUF states it only in newer files (expert_weights_norm);
    # otherwise llama.cpp's fixed choice for the architecture holds, gguf_moe_norm_topk.
    moe_norm_topk: bool | None = None
    gguf_moe_norm_topk: bool = False
    # config.json fields a family's transformers config class defaults, for configs that list
    # only what differs (the text_config of Gemma 3's multimodal checkpoints)
    hf_defaults: dict = field(default_factory=dict, compare=False)
    # The family's own facts, read by the loaders without a line of their own:
    config_keys: tuple[ConfigKey, ...] = ()  # into config.extra
    tensors: tuple[FamilyTensor, ...] = ()  # beyond the common layout
    # What the engine's shared machinery may do with the family's module (allow-lists: a family
    # that does not say so gets neither):
    # the Megatron split rules of distributed/sharding.py hold for its layers (attention's
    # qkv_proj / o_proj, the MLPs' gate_up_proj / down_proj, experts; everything else replicated)
    tensor_parallel: bool = False
    # the compiled decoder stack (models/stack.py) computes its layers: pre-norm Llama layers
    decoder_stack: bool = False

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

    def tensor_shapes(self, config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Every instance of the family's own tensors: module name -> (shape, GGUF name)."""
        return {name: (t.dims(config), gguf) for t in self.tensors for name, gguf in t.names(config)}


# Every registered family, in registration order (nanoinfer/models/__init__.py registers the
# built-in ones when nanoinfer.models is imported, which `import nanoinfer` does).
ARCHITECTURES: tuple[Architecture, ...] = ()


def register(arch: Architecture) -> Architecture:
    """Add a family. Its name and the names its formats give it must be new."""
    global ARCHITECTURES
    for other in ARCHITECTURES:
        clash = ({arch.name} & {other.name} or set(arch.hf_classes) & set(other.hf_classes)
                 or set(arch.hf_model_types) & set(other.hf_model_types) or set(arch.gguf_names) & set(other.gguf_names))
        if clash:
            raise ValueError(f"architecture {arch.name!r}: {sorted(clash)} already registered by {other.name!r}")
    ARCHITECTURES = (*ARCHITECTURES, arch)
    return arch


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
