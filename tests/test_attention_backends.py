"""Attention backends chosen by name and device: one added from outside the package (one
class and one registration line) runs the engine token for token as the default does, and
"auto", unknown names and backends that cannot run where asked behave as documented."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.attention import (
    AttentionBackend,
    AttentionBatch,
    CpuPagedAttention,
    TorchPagedAttention,
    backend_class,
    causal_mask,
    register_backend,
    sdpa,
)
from nanoinfer.cli import main
from nanoinfer.errors import InvalidRequestError
from nanoinfer.kernels import cpu_kernels

from gguf_export import write_gguf_from_hf


@dataclass
class ToyMetadata:
    """FlashAttention's varlen layout: sequence i's queries are rows cu_seqlens_q[i] ..
    cu_seqlens_q[i + 1], its keys the first cu_seqlens_k[i + 1] - cu_seqlens_k[i] slots of
    its row of the page table."""
    slot_mapping: list[torch.Tensor]  # per KV group, [T]
    cu_seqlens_q: torch.Tensor  # [S + 1]
    cu_seqlens_k: torch.Tensor  # [S + 1]
    page_table: list[torch.Tensor]  # per KV group, [S, most blocks], padded with block 0


class ToyAttention(AttentionBackend):
    """Plain PyTorch: each sequence's blocks gathered, then SDPA with a causal mask offset by
    what was cached."""

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu"

    def prepare(self, batch: AttentionBatch) -> ToyMetadata:
        device, bs = self.cache.device, self.cache.block_size
        width = max(-(-n // bs) for n in batch.seq_lens)
        cu_k = [0]
        for n in batch.seq_lens:
            cu_k.append(cu_k[-1] + n)
        return ToyMetadata([torch.tensor(slots, device=device) for slots in batch.slot_mapping],
                           torch.tensor(batch.query_start_loc, device=device), torch.tensor(cu_k, device=device),
                           [torch.tensor([(t + [0] * width)[:width] for t in tables], device=device)
                            for tables in batch.block_tables])

    def forward(self, layer, q, k, v, meta: ToyMetadata):
        kc, vc = self.cache.layer(layer)  # [blocks, block_size, Hkv, D] of the layer's KV group
        g = self.cache.group_of(layer)
        H, D = kc.shape[2:]
        kc.view(-1, H, D)[meta.slot_mapping[g]] = k.to(kc.dtype)  # stored first: queries read the stored values
        vc.view(-1, H, D)[meta.slot_mapping[g]] = v.to(vc.dtype)
        p = self.params[layer]
        out = torch.empty_like(q)
        for i in range(len(meta.page_table[g])):
            q0, q1 = meta.cu_seqlens_q[i:i + 2].tolist()
            n = int(meta.cu_seqlens_k[i + 1] - meta.cu_seqlens_k[i])
            keys = kc[meta.page_table[g][i]].reshape(-1, H, D)[:n].to(q.dtype)
            vals = vc[meta.page_table[g][i]].reshape(-1, H, D)[:n].to(q.dtype)
            out[q0:q1] = sdpa(q[q0:q1], keys, vals, causal_mask(n - (q1 - q0), q1 - q0, p.window, q.device), p)
        return out


register_backend("toy", ToyAttention)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts() -> list[list[int]]:
    """A shared 9-token prefix (prefix-cache hits across blocks of 4), then tails of 1 to 40."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 300, (9,), generator=g).tolist()
    return [prefix + torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 40, 6, 17)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])  # gemma2: sliding windows and soft-capped scores
def test_toy_backend_gives_the_default_tokens(make_hf_model, kind):
    """Chunked prefill (32 tokens a step), batches, prefix-cache hits (the second run), forks."""
    _, path = make_hf_model(kind)
    default = LLM(path, block_size=4, max_num_batched_tokens=32)
    toy = LLM(path, block_size=4, max_num_batched_tokens=32, attention_backend="toy")
    assert type(toy.engine.runner.attention) is ToyAttention
    expected = tokens(default)
    assert tokens(toy) == expected
    assert tokens(toy) == expected  # every prompt's prefix now cached
    n2 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    assert [[s.token_ids for s in o.outputs] for o in toy.generate(prompts()[:2], n2)] == \
           [[s.token_ids for s in o.outputs] for o in default.generate(prompts()[:2], n2)]


def test_metadata_is_prepared_once_per_step(make_hf_model, monkeypatch):
    _, path = make_hf_model("llama")
    llm = LLM(path, block_size=4, max_num_batched_tokens=32, attention_backend="toy")
    calls = {"prepare": 0, "forward": 0}
    prepare, forward = ToyAttention.prepare, ToyAttention.forward

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(ToyAttention, "prepare", counted("prepare", prepare))
    monkeypatch.setattr(ToyAttention, "forward", counted("forward", forward))
    steps = llm.engine.total_steps
    tokens(llm)
    steps = llm.engine.total_steps - steps
    assert calls == {"prepare": steps, "forward": steps * llm.loaded.config.num_layers}


def test_the_compiled_stack_runs_only_for_backends_that_declare_it(make_hf_model, tiny_tokenizer_dir, tmp_path):
    """A GGUF in Q8_0 blocks: the default backend hands its steps to the compiled decoder
    stack; the toy backend (fused_stack not declared) gets every layer's attention itself."""
    model, _ = make_hf_model("llama")
    path = write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "llama.gguf", "Q8_0")
    default = LLM(path, dtype="auto", max_num_batched_tokens=32)
    toy = LLM(path, dtype="auto", max_num_batched_tokens=32, attention_backend="toy")
    expected = tokens(default)
    assert tokens(toy) == expected
    if type(default.engine.runner.attention).fused_stack:
        assert default.loaded.model.__dict__["_decoder_stack"][1] is not None
    assert "_decoder_stack" not in toy.loaded.model.__dict__


def test_auto_picks_the_first_registered_backend_that_runs(llama_dir):
    kernel = CpuPagedAttention if cpu_kernels.library() is not None else TorchPagedAttention
    assert backend_class("auto", "cpu", torch.float32) is kernel
    assert backend_class("auto", "cpu", torch.bfloat16) is kernel
    assert backend_class("auto", "cpu", torch.float16) is TorchPagedAttention  # the kernel has no fp16 cache
    assert backend_class("auto", "cuda", torch.bfloat16) is TorchPagedAttention  # a later registration never
    assert type(LLM(llama_dir).engine.runner.attention) is kernel  # takes auto's place


def test_unknown_name_is_an_error(llama_dir):
    with pytest.raises(InvalidRequestError, match=r"attention_backend='flash' must be one of auto, cpu, torch, toy") as e:
        LLM(llama_dir, attention_backend="flash")
    assert isinstance(e.value, ValueError) and e.value.param == "attention_backend"
    with pytest.raises(ValueError, match="already registered"):
        register_backend("toy", ToyAttention)


def test_backend_that_cannot_run_there_is_an_error(llama_dir):
    with pytest.raises(InvalidRequestError, match=r"attention_backend='toy' cannot run on cuda with a bfloat16 KV cache"):
        backend_class("toy", "cuda", torch.bfloat16)
    with pytest.raises(InvalidRequestError, match=r"'cpu' cannot run on cpu with a float16 KV cache \(these can: torch, toy\)"):
        LLM(llama_dir, dtype="float16", attention_backend="cpu")  # never a silent fallback


def test_cli_flag(llama_dir, capsys):
    assert main(["generate", "Hello", "--model", str(llama_dir), "-t", "0", "-n", "6", "--ignore-eos", "--no-echo",
                 "--attention-backend", "toy"]) == 0
    out = capsys.readouterr().out
    assert out == LLM(llama_dir).generate("Hello", SamplingParams(temperature=0, max_tokens=6,
                                                                  ignore_eos=True))[0].outputs[0].text + "\n"
    assert main(["generate", "Hello", "--model", str(llama_dir), "--attention-backend", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: attention_backend='nope' must be one of") and "\n" not in err
