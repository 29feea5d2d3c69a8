"""The compiled decoder stack (kernels/decoder_stack.py) against the layer modules it stands in
for: the same tokens and the same logprob bits, for every Llama-family feature it carries
(q/k/v bias, q/k norms, a sliding window, grouped-query attention, tied heads, SmolLM3's NoPE
layers, Phi-3's fused checkpoints and LongRoPE, Gemma 2 and 3's sandwich norms, GELU MLP,
soft-caps and local rotary tables, OLMo 2's post-norm layers and q/k norms over all heads, the
routed experts of Qwen3-MoE and Mixtral), in batches
with chunked prefill, on each dispatch path."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.kernels import quant

from gguf_export import write_gguf_from_hf

# kind, tied head, weight type: together every branch of the stack
CASES = [("llama", False, "Q4_1"), ("qwen2", True, "Q8_0"), ("qwen3", False, "Q5_0"), ("mistral", False, "Q4_0"),
         ("smollm3", False, "Q8_0"), ("phi3", False, "Q4_0"), ("phi3_longrope", False, "Q8_0"),
         ("gemma2", True, "Q8_0"), ("gemma3", True, "Q4_0"), ("olmo2", False, "Q5_1"),
         ("qwen3moe", False, "Q8_0"), ("mixtral", False, "Q4_0")]


@pytest.fixture(scope="module")
def ggufs(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stack_ggufs")
    return {kind: write_gguf_from_hf(make_hf_model(kind, tie=tie)[0], tiny_tokenizer_dir, folder / f"{kind}.gguf", qtype)
            for kind, tie, qtype in CASES}


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (3, 19, 40, 7, 26)]


def run(llm: LLM, use_stack: bool):
    model = llm.loaded.model
    model.use_decoder_stack = use_stack
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=4)
    outs = llm.generate(prompts(), params)
    return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("kind", [c[0] for c in CASES])
def test_stack_computes_the_layer_modules_bits(ggufs, kind, quant_path):
    if cpu_stack_unavailable():
        pytest.skip("no compiled kernels")
    llm = LLM(ggufs[kind], dtype="auto", max_num_batched_tokens=32)  # prompts split across steps
    with_stack = run(llm, True)
    built = llm.loaded.model.__dict__.get("_decoder_stack")
    assert built is not None and built[1] is not None, "the stack did not run"
    assert run(llm, False) == with_stack


def k_quant_blocks(qtype: int, rows: int, K: int, seed: int) -> np.ndarray:
    """Random K-quant rows (gguf-py cannot quantise to them) with small scales, so that a
    model built from them keeps finite activations."""
    import gguf

    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, K // bs, ts), dtype=np.uint8)
    d = np.array([0.004], dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        b[:, :, 192:208] = rng.integers(-4, 5, size=(rows, K // bs, 16)).astype(np.int8).view(np.uint8)
        b[:, :, 208:210] = d
    else:  # Q4_K, Q5_K: d, dmin, then 12 bytes of 6-bit scales and mins (kept below 4)
        b[:, :, 0:2] = d
        b[:, :, 2:4] = d
        b[:, :, 4:16] &= 3
    return b.reshape(rows, -1)


def test_stack_with_mixed_k_quants_in_one_projection(make_hf_model, tiny_tokenizer_dir, tmp_path):
    """A Q4_K_M file's layout: q and k in Q4_K, v in Q6_K inside the fused q/k/v projection,
    gate/up in Q5_K and Q4_K, down in Q6_K. The formats quantise the activations differently
    (Q6_K's sums run per 16 values, Q4_K's per 32), so one part's quantised activations must
    not serve another: the stack gives the modules' bits."""
    import gguf
    import transformers as tf
    from transformers import AutoTokenizer

    if cpu_stack_unavailable():
        pytest.skip("no compiled kernels")
    T = gguf.GGMLQuantizationType
    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    types = {"attn_q": (T.Q4_K, 256), "attn_k": (T.Q4_K, 128), "attn_v": (T.Q6_K, 128), "attn_output": (T.Q5_K, 256),
             "ffn_gate": (T.Q5_K, 512), "ffn_up": (T.Q4_K, 512), "ffn_down": (T.Q6_K, 256)}
    raw = {}
    for layer in range(2):
        for i, (name, (qtype, rows)) in enumerate(types.items()):
            K = 512 if name == "ffn_down" else 256
            raw[f"blk.{layer}.{name}.weight"] = (k_quant_blocks(qtype, rows, K, 10 * layer + i), qtype)
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "mixed.gguf", "Q8_0", raw_tensors=raw)
    llm = LLM(path, dtype="auto", max_num_batched_tokens=32)
    formats = llm.loaded.info["tensor_formats"]
    assert formats["Q4_K"] == 6 and formats["Q6_K"] == 4 and formats["Q5_K"] == 4
    with_stack = run(llm, True)
    assert llm.loaded.model.__dict__["_decoder_stack"][1] is not None
    assert all(math.isfinite(lp) for _, lps in with_stack for d in lps for lp in d.values())
    assert run(llm, False) == with_stack


def test_stack_over_an_fp32_cache(ggufs):
    """kv_cache_dtype="float32" on the block-format path (bf16 is its default): the same bits too."""
    llm = LLM(ggufs["qwen3"], dtype="auto", kv_cache_dtype="float32", max_num_batched_tokens=32)
    assert llm.engine.cache.dtype == torch.float32
    assert run(llm, True) == run(llm, False)


def test_stack_over_a_q8_0_cache(ggufs):
    """kv_cache_dtype="q8_0": the stack quantises k and v as the modules' path does, and reads them alike."""
    if cpu_stack_unavailable():
        pytest.skip("no compiled kernels")
    llm = LLM(ggufs["qwen3"], dtype="auto", kv_cache_dtype="q8_0", max_num_batched_tokens=32)
    assert llm.engine.cache.dtype == torch.uint8
    with_stack = run(llm, True)
    assert llm.loaded.model.__dict__["_decoder_stack"][1] is not None
    assert run(llm, False) == with_stack


def test_kv_cache_dtype_rule(ggufs):
    from nanoinfer.errors import InvalidRequestError

    assert LLM(ggufs["llama"], dtype="auto").engine.cache.dtype == torch.bfloat16  # weights in blocks
    assert LLM(ggufs["llama"], dtype="float32").engine.cache.dtype == torch.float32  # the model's dtype
    assert LLM(ggufs["llama"], dtype="bfloat16").engine.cache.dtype == torch.bfloat16
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(ggufs["llama"], dtype="auto", kv_cache_dtype="fp8")


def test_stack_follows_a_new_cache(ggufs):
    """A second engine on the same model gets a stack over its own cache, not the first's."""
    if cpu_stack_unavailable():
        pytest.skip("no compiled kernels")
    first = LLM(ggufs["llama"], dtype="auto")
    expected = run(first, True)
    second = LLM(ggufs["llama"], dtype="auto")
    second.engine.runner.model = first.loaded.model  # the same module, a fresh pool
    assert run(second, True) == expected
    assert first.loaded.model.__dict__["_decoder_stack"][0] is second.engine.cache


def test_the_modules_run_where_the_stack_cannot(ggufs):
    """bf16 weights (neither in GGUF blocks nor packed fp32) keep the module path."""
    llm = LLM(ggufs["llama"], dtype="bfloat16")
    run(llm, True)
    assert llm.loaded.model.__dict__["_decoder_stack"][1] is None


@pytest.mark.parametrize("kind", ["llama_f32", "qwen3moe_f32"])
def test_stack_on_fp32_weights(make_hf_model, tiny_tokenizer_dir, tmp_path, kind, quant_path):
    """fp32 linears run in the stack on the packed GEMM their PackedLinear modules call: a dense
    model loaded in float32, and an F32 file as stored (its attention packed fp32, its experts
    the F32 record's), both over their fp32 cache. The same bits as the modules, and each
    prompt's tokens and logprobs alone are those it has in the batch."""
    if cpu_stack_unavailable():
        pytest.skip("no compiled kernels")
    family = kind.removesuffix("_f32")
    path = write_gguf_from_hf(make_hf_model(family)[0], tiny_tokenizer_dir, tmp_path / f"{kind}.gguf", "F32")
    llm = LLM(path, dtype="float32" if family == "llama" else "auto", max_num_batched_tokens=32)
    if family == "qwen3moe":
        assert llm.loaded.info["tensor_formats"].get("F32")  # the experts as stored
    assert llm.engine.cache.dtype == torch.float32
    with_stack = run(llm, True)
    assert llm.loaded.model.__dict__["_decoder_stack"][1] is not None, "the stack did not run"
    assert run(llm, False) == with_stack
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=4)
    llm.loaded.model.use_decoder_stack = True
    for prompt, expected in zip(prompts(), with_stack, strict=True):
        out = llm.generate([prompt], params)[0].outputs[0]
        assert (out.token_ids, [{k: v.logprob for k, v in d.items()} for d in out.logprobs]) == expected


def cpu_stack_unavailable() -> bool:
    import gguf

    return not quant.supported(int(gguf.GGMLQuantizationType.Q8_0))


def test_the_stack_runs_only_the_features_it_computes(ggufs, tmp_path):
    """An allow-list: a family that turns the stack on but whose layers need a feature it does not
    compute (a norm placement it does not know, an activation it has no row for, a layer class of its own) runs
    its modules, with the module path's tokens."""
    from nanoinfer.models import stack
    from nanoinfer.models.llama import DecoderLayer

    llm = LLM(ggufs["qwen3"], dtype="auto")
    model = llm.loaded.model
    assert stack.unsupported_features(model) == frozenset() and "qk_norm" in model.layer_features()
    expected = run(llm, False)
    model.config.norm_layout = "peri"  # norms around each branch, which the stack does not place
    assert stack.unsupported_features(model) == {"norm_peri"}
    model.config.norm_layout = "pre"
    model.model.layers[1].mlp.act = "relu2"  # an activation the stack has no row for
    assert stack.unsupported_features(model) == {"mlp_relu2"}
    model.model.layers[1].mlp.act = "silu"

    class ScaledLayer(DecoderLayer):
        pass

    layers = model.model.layers
    layers[1].__class__ = ScaledLayer
    assert stack.unsupported_features(model) == {"layer:ScaledLayer"}
    model.__dict__.pop("_decoder_stack", None)
    assert run(llm, True) == expected  # the stack was not built: the modules ran
    assert model.__dict__["_decoder_stack"][1] is None
    layers[1].__class__ = DecoderLayer


def test_a_shared_expert_keeps_the_modules(make_hf_model, tiny_tokenizer_dir, tmp_path):
    """Qwen2-MoE's shared expert is a feature the stack does not compute: its layers run as modules."""
    from nanoinfer.models import stack

    path = write_gguf_from_hf(make_hf_model("qwen2moe")[0], tiny_tokenizer_dir, tmp_path / "q2moe.gguf", "Q8_0")
    llm = LLM(path, dtype="auto")
    model = llm.loaded.model
    assert model.use_decoder_stack and stack.unsupported_features(model) == {"shared_expert"}
    expected = run(llm, False)
    assert run(llm, True) == expected
    assert model.__dict__["_decoder_stack"][1] is None
