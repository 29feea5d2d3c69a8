"""GGUF weights run as stored (dtype="auto"): parity with the uncached loop on the same kernels,
closeness to the dequantised fp32 model, batch invariance, and the fallback for a type
without a kernel."""
from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.kernels import quant
from nanoinfer.kernels.quant_linear import QuantEmbedding, QuantLinear
from nanoinfer.loaders import load_files
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.reference import generate_uncached

from gguf_export import write_gguf_from_hf

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16"]


@pytest.fixture(scope="module")
def ggufs(make_hf_model, tiny_tokenizer_dir, tmp_path_factory):
    model, _ = make_hf_model("qwen2", tie=True)  # biases, GQA, a tied (quantised) head
    folder = tmp_path_factory.mktemp("quant_ggufs")
    files = {t: write_gguf_from_hf(model, tiny_tokenizer_dir, folder / f"{t}.gguf", t) for t in TYPES}
    llama, _ = make_hf_model("llama")  # q/k rows permuted by llama.cpp's converter: put back row by row
    files["llama-Q8_0"] = write_gguf_from_hf(llama, tiny_tokenizer_dir, folder / "llama-Q8_0.gguf", "Q8_0")
    return files


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kernels_or_skip(qtype_name: str) -> None:
    import gguf

    if not quant.supported(int(gguf.GGMLQuantizationType[qtype_name])):
        pytest.skip(f"no {qtype_name} kernel on this machine")


@pytest.mark.parametrize("qtype", TYPES)
def test_weights_stay_in_their_format(ggufs, qtype):
    kernels_or_skip(qtype)
    llm = LLM(ggufs[qtype], dtype="auto")
    model = llm.loaded.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.part0.data_ptr() == model.model.embed_tokens.data.data_ptr()  # tied: the same blocks
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert llm.loaded.info["tensor_formats"][qtype] >= 1


@pytest.mark.parametrize("qtype", [*TYPES, "llama-Q8_0"])
def test_engine_matches_the_uncached_loop_on_the_same_kernels(ggufs, qtype):
    kernels_or_skip(qtype.removeprefix("llama-"))
    llm = LLM(ggufs[qtype], dtype="auto")
    p = prompt(11, 1)
    assert llm.engine.cache.dtype == torch.bfloat16  # the default cache on this path
    # the reference rounds k and v as that cache stores them
    ref_tokens, ref_logits = generate_uncached(llm.loaded.model, p, 24, kv_dtype=torch.bfloat16)
    out = llm.generate({"prompt_token_ids": p},
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))[0].outputs[0]
    assert out.token_ids == ref_tokens[:len(out.token_ids)] and len(out.token_ids) == 24
    # The linears are the same kernels, row for row; attention differs in float order (paged
    # decode against causal SDPA over the whole sequence), about 1e-7, and now and then such a
    # difference moves an activation across an 8-bit rounding step: a jump of a few 1e-2, and
    # the steps after it (their cache holds the moved value) differ by up to that much too.
    # So: one step agrees to 1e-6, a third of them at least to 1e-5, every one to 0.1.
    diffs = sorted(abs(lp[tok].logprob - float(torch.log_softmax(logits, -1)[tok]))
                   for lp, logits, tok in zip(out.logprobs, ref_logits, out.token_ids))
    assert diffs[0] < 1e-6 and diffs[len(diffs) // 3] < 1e-5 and diffs[-1] < 0.1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "llama-Q8_0", "F16"])
def test_close_to_the_dequantised_model(ggufs, qtype):
    """The same weights, dequantised and run in fp32: only the activations' rounding to 8 bits
    per block of 32 (about 0.3% of a block's largest value per element and matmul) separates
    them. This random tiny model (weights of std 0.2) amplifies that through its layers to
    about 3% RMS of the logits (measured 3.0-3.4%); F16 weights take fp32 activations: equal."""
    kernels_or_skip(qtype.removeprefix("llama-"))
    ids = torch.tensor(prompt(40, 2))
    with torch.inference_mode():
        ours = LLM(ggufs[qtype], dtype="auto").loaded.model(ForwardBatch.whole(ids))
        dense = LLM(ggufs[qtype], dtype="float32").loaded.model(ForwardBatch.whole(ids))
    rms = float((ours - dense).pow(2).mean().sqrt() / dense.pow(2).mean().sqrt())
    if qtype == "F16":
        assert rms < 1e-5
    else:
        assert 1e-4 < rms < 0.05  # rounded, and not by much
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def check_alone_and_beside(path, prompt_len: int, crowd: int, max_tokens: int, budget: int) -> None:
    """A request's greedy tokens and logprobs alone, and in the middle of `crowd` others with
    chunked prefill (a budget of `budget` tokens a step): the same bits."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    target = {"prompt_token_ids": prompt(prompt_len, 7)}
    alone = LLM(path, dtype="auto").generate(target, params)[0].outputs[0]
    llm = LLM(path, dtype="auto", max_num_batched_tokens=budget)
    others = [{"prompt_token_ids": prompt(5 + i % 23, 100 + i)} for i in range(crowd)]
    beside = llm.generate(others[:crowd // 2] + [target] + others[crowd // 2:], params)[crowd // 2].outputs[0]
    assert beside.token_ids == alone.token_ids
    assert [{k: v.logprob for k, v in d.items()} for d in beside.logprobs] == \
           [{k: v.logprob for k, v in d.items()} for d in alone.logprobs]


def test_rows_are_bit_identical_whatever_runs_beside_them(ggufs, quant_path):
    """A request's logprobs alone, and beside 40 others with chunked prefill: the same bits,
    on each dispatch path this CPU has (forced one by one)."""
    kernels_or_skip("Q4_1")
    check_alone_and_beside(ggufs["Q4_1"], 37, 40, 12, 48)


def test_a_type_without_a_kernel_is_dequantised_with_a_line(ggufs, monkeypatch, capsys):
    import gguf

    q40 = int(gguf.GGMLQuantizationType.Q4_0)
    supported = quant.supported
    monkeypatch.setattr(quant, "supported", lambda t: t != q40 and supported(t))
    llm = LLM(ggufs["Q4_0"], dtype="auto")
    lines = [line for line in capsys.readouterr().err.splitlines() if "dequantised to float32" in line]
    n = sum(t.qtype == q40 for t in load_files(ggufs["Q4_0"], dtype=None).state.values() if hasattr(t, "qtype"))
    assert n > 3 and len(lines) == 1  # one line for the format and its reason, naming the count
    assert lines[0].startswith(f"nanoinfer: {n} Q4_0 tensor(s) dequantised to float32 at load (no kernel for Q4_0): ")
    assert f"and {n - 3} more" in lines[0]
    assert llm.loaded.info["tensor_formats"].get("Q4_0") is None
    assert len(llm.generate(prompt(5, 3), SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_weights_are_counted_in_their_format(ggufs):
    """Parameters by logical size, bytes as stored: the roofline reads what decode reads."""
    from nanoinfer.bench.roofline import Roofline
    from nanoinfer.kernels.quant_linear import parameter_count

    kernels_or_skip("Q8_0")
    quantised = LLM(ggufs["Q8_0"], dtype="auto").loaded
    dense = LLM(ggufs["Q8_0"], dtype="float32").loaded
    assert parameter_count(quantised.model) == parameter_count(dense.model)
    q = Roofline.for_model(quantised.model, quantised.config).weights
    d = Roofline.for_model(dense.model, dense.config).weights
    # Q8_0: 34 bytes per 32 weights against 4 bytes each; vectors (norms, biases) stay fp32
    assert q.lm_head == d.lm_head * 34 // 128 and 0.2 < q.body / d.body < 0.35
