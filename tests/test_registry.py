"""The architecture registry: one list for every format, and a new family is one module plus
one entry (nothing in the loaders, the engine or the surfaces changes)."""
from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
from torch import nn

import nanoinfer.models
from nanoinfer import LLM, SamplingParams, registry
from nanoinfer.errors import ModelLoadError
from nanoinfer.models.builder import load_model, model_class
from nanoinfer.models.llama import LlamaForCausalLM

from gguf_export import write_gguf_from_hf


def test_every_entry_names_a_module_that_serves():
    for arch in registry.ARCHITECTURES:
        cls = model_class(arch.name)
        assert issubclass(cls, nn.Module)
        assert all(callable(getattr(cls, m, None)) for m in ("load_weights", "reset_rope", "forward"))


def test_names_are_unique_across_the_list():
    for field in ("name", "hf_classes", "hf_model_types", "gguf_names"):
        names = [n for a in registry.ARCHITECTURES for n in ((getattr(a, field),) if field == "name"
                                                             else getattr(a, field))]
        assert len(names) == len(set(names)), field


def test_hf_and_gguf_are_recognised_through_the_same_entry(make_hf_model, tiny_tokenizer_dir, tmp_path):
    model, folder = make_hf_model("qwen3")
    gguf = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "q.gguf")
    a, b = load_model(folder).config, load_model(gguf).config
    assert a.architecture == b.architecture == registry.for_hf(["Qwen3ForCausalLM"], None).name
    assert a.qk_norm and b.qk_norm  # the entry's adapter, whatever the file states
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        registry.for_gguf("gpt2")


class TwinForCausalLM(LlamaForCausalLM):
    """A stand-in for a new family's module (here it keeps Llama's maths and names)."""

    built = 0

    def __init__(self, config):
        super().__init__(config)
        TwinForCausalLM.built += 1


def test_a_new_family_is_one_module_and_one_entry(make_hf_model, monkeypatch, tmp_path):
    """An HF folder whose config.json says TwinForCausalLM loads, generates and serves once the
    registry has one entry for it: no loader, engine or surface knows the name."""
    _, src = make_hf_model("llama")
    path = tmp_path / "twin"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["TwinForCausalLM"],
                                                  "model_type": "twin", "twin_factor": 3}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(path)
    entry = registry.Architecture("twin", f"{__name__}:TwinForCausalLM", hf_classes=("TwinForCausalLM",))
    monkeypatch.setattr(registry, "ARCHITECTURES", (*registry.ARCHITECTURES, entry))
    llm = LLM(path)
    assert isinstance(llm.loaded.model, TwinForCausalLM) and TwinForCausalLM.built == 1
    assert llm.loaded.config.architecture == "twin"
    assert llm.loaded.config.extra["hf_config"]["twin_factor"] == 3  # the family's own fields reach it
    ours = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    plain = LLM(src).generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert ours.token_ids == plain.token_ids


def test_every_model_module_is_kept_off_the_loaders():
    """pyproject's forbidden contract (a model module imports no loader, tokenizer, sampling or
    builder) names every module of nanoinfer.models but the builder, which joins loaders and
    modules by design (and the package's __init__, which registers the built-in facts)."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    contract = next(c for c in pyproject["tool"]["importlinter"]["contracts"] if c["type"] == "forbidden"
                    and "nanoinfer.loaders" in c["forbidden_modules"])
    modules = {f"nanoinfer.models.{p.stem}" for p in Path(nanoinfer.models.__file__).parent.glob("*.py")}
    assert set(contract["source_modules"]) == modules - {"nanoinfer.models.builder", "nanoinfer.models.__init__"}


def test_facts_reach_every_consumer_through_the_entry():
    """Tensor parallelism and the compiled stack are allow-lists in the families' entries."""
    split = {a.name for a in registry.ARCHITECTURES if a.tensor_parallel}
    assert split == {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "olmo2", "gemma2", "gemma3",
                     "qwen2moe", "qwen3moe", "mixtral"}
    assert {a.name for a in registry.ARCHITECTURES if a.decoder_stack} == {
        "llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3", "olmo2",  # llama.py's parts, arranged
        "qwen2moe", "qwen3moe", "mixtral"}  # (and routed experts: a shared expert keeps the modules, by feature)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Architecture("copy", ".llama:LlamaForCausalLM", gguf_names=("qwen3",)))
