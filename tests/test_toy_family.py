"""A family from outside the package with a config key and a tensor of its own, added in exactly
the places docs/architecture.md ("How to add an architecture") names: a module, its facts (one
registry.Architecture) and one registration. Nothing in the loaders, the builder, the engine or
tensor parallelism knows it; a Hugging Face folder and a GGUF file of it load through the
normal path, and the key and the tensor arrive and change the output as the maths says
(checked against transformers' Llama with the toy's step added by hooks)."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from nanoinfer import LLM, SamplingParams, registry
from nanoinfer.distributed.sharding import check_divisible
from nanoinfer.errors import ModelLoadError
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.models.builder import load_model
from nanoinfer.models.llama import DecoderLayer, LlamaForCausalLM

from gguf_export import write_gguf_from_hf


# --- 1. the module: Llama with each layer's MLP output scaled by my_scale * my_gain -------------
class ToyDecoderLayer(DecoderLayer):
    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.my_gain = nn.Parameter(torch.ones(config.hidden_size))  # the new tensor
        self.my_scale = config.extra["my_scale"]  # the new config key, whatever the format

    def forward(self, x, residual, cos, sin, batch):
        x, residual = super().forward(x, residual, cos, sin, batch)  # x: the MLP's output
        return x * (self.my_scale * self.my_gain), residual


class ToyForCausalLM(LlamaForCausalLM):
    layer_class = ToyDecoderLayer


# --- 2. its facts, one record -------------------------------------------------------------------
TOY = registry.Architecture(
    "toy", f"{__name__}:ToyForCausalLM", hf_classes=("ToyForCausalLM",), gguf_names=("toy",),
    config_keys=(registry.ConfigKey("my_scale"),),  # config.json "my_scale", GGUF "toy.my_scale"
    tensors=(registry.FamilyTensor("model.layers.{layer}.my_gain", ("hidden_size",),
                                   gguf="blk.{layer}.my_gain.weight"),),
    tensor_parallel=True)  # a replicated vector: sharding's rules hold


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(registry, "ARCHITECTURES", registry.ARCHITECTURES)  # undone after the test
    registry.register(TOY)  # --- 3. the registration
    return TOY


# --- files of it, and the reference ---------------------------------------------------------------
def gains(hf_model) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [0.5 + torch.rand(hf_model.config.hidden_size, generator=g) for _ in range(hf_model.config.num_hidden_layers)]


def toy_folder(make_hf_model, path, scale=0.75, gain_shape=None):
    hf, src = make_hf_model("llama")
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["ToyForCausalLM"], model_type="toy")
    if scale is not None:
        config["my_scale"] = scale
    (path / "config.json").write_text(json.dumps(config))
    save_file({f"model.layers.{i}.my_gain": g if gain_shape is None else torch.ones(gain_shape)
               for i, g in enumerate(gains(hf))}, str(path / "toy-extra.safetensors"))
    return path


def toy_gguf(make_hf_model, tokenizer_dir, path, scale=1.5):
    hf, _ = make_hf_model("llama")
    return write_gguf_from_hf(hf, tokenizer_dir, path, arch="toy", name="toy", extra_fields={"my_scale": scale},
                              extra_tensors={f"blk.{i}.my_gain.weight": g.numpy() for i, g in enumerate(gains(hf))})


def reference_logits(make_hf_model, ids: list[int], scale: float) -> torch.Tensor:
    """transformers' Llama on the same weights, each layer's MLP output times scale * gain."""
    hf = copy.deepcopy(make_hf_model("llama")[0])
    for layer, g in zip(hf.model.layers, gains(hf)):
        layer.mlp.register_forward_hook(lambda m, args, out, g=g: out * (scale * g))
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [5, 17, 42, 99, 7, 63, 21, 250]


def logits(loaded) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(ForwardBatch.whole(torch.tensor(IDS)))


# --- the checks -----------------------------------------------------------------------------------
def test_unknown_until_registered(make_hf_model, tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(toy_folder(make_hf_model, tmp_path / "toy"))


def test_hf_folder(toy, make_hf_model, tmp_path):
    loaded = load_model(toy_folder(make_hf_model, tmp_path / "toy", scale=0.75))
    assert isinstance(loaded.model, ToyForCausalLM) and loaded.config.architecture == "toy"
    assert loaded.config.extra["my_scale"] == 0.75
    hf = make_hf_model("llama")[0]
    for layer, g in zip(loaded.model.model.layers, gains(hf)):
        assert torch.equal(layer.my_gain.detach(), g)
    ours = logits(loaded)
    torch.testing.assert_close(ours, reference_logits(make_hf_model, IDS, 0.75), atol=1e-4, rtol=1e-4)
    plain = logits(load_model(make_hf_model("llama")[1]))
    assert (ours - plain).abs().max() > 0.1  # the key and the tensor change the output


def test_gguf_file(toy, make_hf_model, tiny_tokenizer_dir, tmp_path):
    for dtype in (torch.float32, None):  # dequantised, and as stored
        loaded = load_model(toy_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "toy.gguf", scale=1.5), dtype=dtype)
        assert loaded.config.architecture == "toy" and loaded.config.extra["my_scale"] == 1.5
        torch.testing.assert_close(logits(loaded), reference_logits(make_hf_model, IDS, 1.5), atol=1e-4, rtol=1e-4)


def test_serves_and_splits(toy, make_hf_model, tmp_path):
    """The engine serves it like any family; tensor parallelism's check reads its facts."""
    llm = LLM(toy_folder(make_hf_model, tmp_path / "toy", scale=0.75))
    out = llm.generate([IDS], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    ids = list(IDS)
    for _ in range(6):  # greedy on the reference
        ids.append(int(reference_logits(make_hf_model, ids, 0.75)[-1].argmax()))
    assert out == ids[len(IDS):]
    check_divisible(llm.loaded.config, 2)  # its entry says tensor_parallel
    registry.ARCHITECTURES = tuple(a for a in registry.ARCHITECTURES if a is not TOY)
    registry.register(registry.Architecture("toy", TOY.model, hf_classes=("ToyForCausalLM",)))
    with pytest.raises(ModelLoadError, match="tensor parallelism is not implemented for toy"):
        check_divisible(llm.loaded.config, 2)


def test_bad_files_fail_in_one_line(toy, make_hf_model, tiny_tokenizer_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="missing field 'my_scale'"):
        load_model(toy_folder(make_hf_model, tmp_path / "a", scale=None))
    with pytest.raises(ModelLoadError, match="my_scale must be a finite number"):
        load_model(toy_folder(make_hf_model, tmp_path / "b", scale="big"))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.my_gain of shape \[64\]"):
        load_model(toy_folder(make_hf_model, tmp_path / "c", gain_shape=(32,)))
    hf, _ = make_hf_model("llama")
    path = write_gguf_from_hf(hf, tiny_tokenizer_dir, tmp_path / "d.gguf", arch="toy", extra_fields={"my_scale": 1.0})
    with pytest.raises(ModelLoadError, match="lacks tensor blk.0.my_gain.weight"):
        load_model(path)
