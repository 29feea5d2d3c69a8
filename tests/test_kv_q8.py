"""The q8_0 KV cache (kv_cache_dtype="q8_0", attention/kv_cache.py): GGML's q8_0 blocks per token
and head (head sizes 32, 64 and 96), the C++ quantiser and the PyTorch one byte for byte, the engine against the uncached
loop rounding k and v the same way (both attention backends), each row's bits the same alone,
batched and chunked, the decoder stack's bits the modules' (tests/test_decoder_stack.py), and
the pool's bytes."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.attention import kv_cache
from nanoinfer.errors import InvalidRequestError
from nanoinfer.kernels import cpu_kernels
from nanoinfer.reference import generate_uncached

from gguf_export import write_gguf_from_hf


@pytest.fixture(scope="module")
def qwen3_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):  # head_dim 32: one q8_0 block per head
    return write_gguf_from_hf(make_hf_model("qwen3")[0], tiny_tokenizer_dir,
                              tmp_path_factory.mktemp("q8kv") / "qwen3.gguf", "Q8_0")


def tiny_qwen2(tiny_tokenizer_dir, head_dim: int, seed: int):
    """A random 2-layer Qwen2 (q/k/v bias) with two query heads of head_dim over one kv head."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    cfg = tf.Qwen2Config(vocab_size=len(tok), hidden_size=2 * head_dim, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_theta=1000000.0)
    torch.manual_seed(seed)
    return tf.Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def wide_gguf(tiny_tokenizer_dir, tmp_path_factory):
    """head_dim 64: k and v rotated before they are quantised (a Llama with q/k/v bias: Qwen2's outliers)."""
    model = tiny_qwen2(tiny_tokenizer_dir, 64, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("k_proj.bias"):
                p.copy_(torch.randn_like(p) * (torch.arange(p.numel()) % 64 == 3) * 20)  # an outlier channel
    return write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path_factory.mktemp("q8kv") / "wide.gguf", "Q8_0")


@pytest.fixture(scope="module")
def odd_gguf(tiny_tokenizer_dir, tmp_path_factory):
    """head_dim 96 (Phi-3 mini's): three q8_0 blocks a head, not rotated (64 does not divide it)."""
    return write_gguf_from_hf(tiny_qwen2(tiny_tokenizer_dir, 96, seed=1), tiny_tokenizer_dir,
                              tmp_path_factory.mktemp("q8kv") / "odd.gguf", "Q8_0")


@pytest.fixture(params=["qwen3", "wide", "odd"])
def model_file(request, qwen3_gguf, wide_gguf, odd_gguf):
    return {"qwen3": qwen3_gguf, "wide": wide_gguf, "odd": odd_gguf}[request.param]


def test_blocks_are_ggml_q8_0_and_both_quantisers_agree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, 64, generator=g) * torch.rand(400, 3, 1, generator=g) * 10
    x[0, 0, :32] = 0  # a zero block: d = 0, q = 0
    x[1, 1, 5] = 1e-30  # a subnormal scale
    x[2, 2, :] = 1e-6
    x[3, 0, 7] = 60000.0
    x[4, 1, :32] = torch.linspace(-3.5, 3.5, 32) * (1 / 127) * 3.5  # values at half steps: ties to even
    x[5, 0, :] = torch.randn(64, generator=g) * 1e-5  # fp16-subnormal scales, coarser than the candidates
    x[6, 2, 3] = 2e7  # a scale past fp16's range (inf): the same bytes from both
    stored = kv_cache.quantize_q8(x)
    assert stored.shape == (400, 3, 68) and stored.dtype == torch.uint8
    if cpu_kernels.library() is not None:
        assert torch.equal(cpu_kernels.kv_quantize_q8(x), stored)
    x[6, 2, 3] = 0.0
    stored = kv_cache.quantize_q8(x)
    back = kv_cache.read(stored, torch.float32)
    ggml = gguf.quants.dequantize(stored.reshape(-1, 34).numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(back.numpy().reshape(-1), ggml.reshape(-1))  # GGML's layout and values
    xb, bb = x.reshape(400, 3, 2, 32), back.reshape(400, 3, 2, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d16 = stored.reshape(400, 3, 2, 34)[..., :2].contiguous().view(torch.float16).float()
    # the scale is one of the candidates, max|x| / n for n in 127 .. 120 (as fp16: relative 2^-11, 2^-25 where subnormal)
    assert ((d16 >= amax / 127 * (1 - 2 ** -11) - 2 ** -25) & (d16 <= amax / 120 * (1 + 2 ** -11) + 2 ** -25)).all()
    err = (bb - xb).abs()
    # half a step of the chosen scale, plus, where the scale is fp16-subnormal, what its rounding clips
    assert (err <= d16 * 0.5 * (1 + 2 ** -10) + 127 * 2 ** -25).all()
    assert torch.equal(back[0, 0, :32], torch.zeros(32))
    # no candidate has a smaller squared error (up to the 1/4096-step rounding of the comparison)
    errs = []
    for n in kv_cache.Q8_SCALE_DIVISORS:
        d = (amax * torch.tensor(1 / n, dtype=torch.float32)).half().float()
        q = torch.round(xb * torch.where(d > 0, 1 / d, torch.zeros(()))).clamp(-127, 127)
        errs.append(((q * d).double() - xb.double()).pow(2).sum(-1))
    chosen = (bb.double() - xb.double()).pow(2).sum(-1)
    assert (chosen <= torch.stack(errs).amin(0) * (1 + 1e-3) + d16.double().squeeze(-1) ** 2 * 2 ** -10).all()
    # and the search pays: over a tenth less squared error than the single scale max|x| / 127 (the first candidate)
    assert kv_cache.Q8_SCALE_DIVISORS[0] == 127 and chosen.sum() < 0.9 * errs[0].sum()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_engine_matches_the_uncached_loop_with_the_same_rounding(model_file, backend):
    if backend == "cpu" and cpu_kernels.library() is None:
        pytest.skip("no compiled kernels")
    llm = LLM(model_file, dtype="auto", kv_cache_dtype="q8_0", attention_backend=backend)
    assert llm.engine.cache.dtype == kv_cache.Q8_0
    p = prompt(13, 1)
    ref_tokens, ref_logits = generate_uncached(llm.loaded.model, p, 20, kv_dtype=kv_cache.Q8_0)
    out = llm.generate({"prompt_token_ids": p},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1))[0].outputs[0]
    assert out.token_ids == ref_tokens
    # (attention's float order differs from the loop's SDPA: see test_quant_path's note)
    diffs = sorted(abs(lp[tok].logprob - float(torch.log_softmax(logits, -1)[tok]))
                   for lp, logits, tok in zip(out.logprobs, ref_logits, out.token_ids))
    assert diffs[0] < 1e-6 and diffs[len(diffs) // 3] < 1e-5 and diffs[-1] < 0.1
    # the rounding is real: an fp32 cache gives other logprobs
    f32 = LLM(model_file, dtype="auto", kv_cache_dtype="float32", attention_backend=backend)
    other = f32.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                 logprobs=1))[0].outputs[0]
    assert [d[t].logprob for d, t in zip(other.logprobs, other.token_ids)] != \
        [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


def test_rows_are_the_same_alone_batched_and_chunked(model_file):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": prompt(n, s)} for s, n in enumerate((5, 40, 17, 29))]

    def bits(outs):
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    alone = bits([LLM(model_file, dtype="auto", kv_cache_dtype="q8_0").generate(p, params)[0] for p in prompts[:2]])
    together = bits(LLM(model_file, dtype="auto", kv_cache_dtype="q8_0", max_num_batched_tokens=16)
                    .generate(prompts, params))
    assert together[:2] == alone


def test_the_stack_gives_the_modules_bits_with_rotation(wide_gguf):
    """head_dim 64: the decoder stack rotates q, k, v and the output inline; the modules call the same C++."""
    if cpu_kernels.library() is None:
        pytest.skip("no compiled kernels")
    llm = LLM(wide_gguf, dtype="auto", kv_cache_dtype="q8_0", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": prompt(n, s)} for s, n in enumerate((5, 40, 17))]

    def run(stack: bool):
        llm.loaded.model.use_decoder_stack = stack
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params)]

    with_stack = run(True)
    assert llm.loaded.model.__dict__["_decoder_stack"][1] is not None
    assert run(False) == with_stack


def test_rotation_spreads_an_outlier():
    """With an outlier channel, the rotated blocks reconstruct the other values far better; the
    rotation is orthonormal (q . k unchanged) and its own inverse; PyTorch's steps give the C++ bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 2, 128, generator=g)
    x[..., 7] *= 60
    rk, rv = kv_cache.rotations(kv_cache.Q8_0, 128)
    assert (rk, rv) == (128, 64) and kv_cache.rotations(kv_cache.Q8_0, 96) == (0, 0)
    assert kv_cache.rotations(torch.bfloat16, 128) == (0, 0)
    back = kv_cache.rotate(kv_cache.read(kv_cache.store(x, kv_cache.Q8_0, rk), torch.float32), rk)
    plain = kv_cache.read(kv_cache.store(x, kv_cache.Q8_0, 0), torch.float32)
    small = torch.ones(128, dtype=torch.bool)
    small[7] = False
    assert (back - x)[..., small].pow(2).mean() < 0.1 * (plain - x)[..., small].pow(2).mean()
    q = torch.randn(200, 2, 128, generator=g)
    torch.testing.assert_close((kv_cache.rotate(q, rk) * kv_cache.rotate(x, rk)).sum(-1), (q * x).sum(-1),
                               rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(kv_cache.rotate(kv_cache.rotate(x, 64), 64), x, rtol=0, atol=1e-4)
    if cpu_kernels.library() is not None:
        from unittest import mock
        with mock.patch.object(cpu_kernels, "library", lambda: None):
            torch_steps = kv_cache.rotate(x, 128), kv_cache.store(x, kv_cache.Q8_0, 128)
        assert torch.equal(torch_steps[0], cpu_kernels.kv_rotate(x, 128))
        assert torch.equal(torch_steps[1], cpu_kernels.kv_quantize_q8(x, 128))


def test_pool_bytes_and_head_sizes(qwen3_gguf, llama_dir):
    q8 = LLM(qwen3_gguf, dtype="auto", kv_cache_dtype="q8_0", kv_cache_memory=8 << 20)
    bf16 = LLM(qwen3_gguf, dtype="auto", kv_cache_dtype="bfloat16", kv_cache_memory=8 << 20)
    per_token = [e.engine.cache.k[0][0, 0, 0].nbytes for e in (q8, bf16)]
    assert per_token[0] / per_token[1] == 34 / 64  # 0.53x
    assert q8.engine.blocks.num_blocks >= 1.8 * bf16.engine.blocks.num_blocks
    with pytest.raises(InvalidRequestError, match="multiple of 32"):  # the tiny llama's heads are 16 wide
        LLM(llama_dir, kv_cache_dtype="q8_0")
