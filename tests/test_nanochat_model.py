"""nanochat checkpoints: the model against a reference forward written here from the spec,
the engine's cached/chunked path against that reference, the loader, and the tokenizer.

The reference (`reference_logits`) is deliberately the other way round from the served
model: one whole sequence, training style (the smear by slicing, the windows as explicit
[T, T] masks, attention as a plain softmax), reading the raw state dict.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import shutil

import pytest
import torch
import torch.nn.functional as F

from nanoinfer import LLM, SamplingParams
from nanoinfer.errors import InvalidRequestError, ModelLoadError
from nanoinfer.loaders import detect_format, load_tokenizer
from nanoinfer.loaders.nanochat import load_nanochat
from nanoinfer.models.batch import ForwardBatch
from nanoinfer.models.builder import build_module, load_model
from nanoinfer.tokenizer import IncrementalDetokenizer, NanochatTokenizer

from nanochat_fixtures import (
    ERAS,
    MODEL_CONFIG,
    build_encoding,
    random_state,
    short_window,
    write_checkpoint,
    write_tokenizer,
)

KV = dict(kv_cache_memory=1 << 22)  # 4 MiB of KV blocks is plenty here
TEXT = ("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b. "
        "日本語のテキストと中文文本。Emoji: 😀 🎉 👍🏽 ❤️ Café, naïve, 12345678 ")

# ---------------------------------------------------------------------------------------------
# The reference, straight from the spec
# ---------------------------------------------------------------------------------------------

# era -> (rotary base, q/k scale); softcap 15 throughout (era D's 20 is not detectable)
REF_CONSTANTS = {"A": (10000.0, 1.0), "B": (10000.0, 1.0), "C/D": (10000.0, 1.0), "E": (100000.0, 1.15),
                 "F": (100000.0, 1.2)}


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def reference_logits(state: dict, era: str, ids: list[int], config: dict = MODEL_CONFIG) -> torch.Tensor:
    sd = {k.removeprefix("_orig_mod."): v.float() for k, v in state.items()}
    theta, qk_scale = REF_CONSTANTS[era]
    n_layer, d, H, Hkv = config["n_layer"], config["n_embd"], config["n_head"], config["n_kv_head"]
    D, T, seq_len = d // H, len(ids), config["sequence_len"]
    idx = torch.tensor(ids)

    x = rms(sd["transformer.wte.weight"][idx])
    if "smear_gate.weight" in sd:  # x_t += lambda * sigmoid(gate(x_t[:24])) * x_{t-1}, t >= 1
        gate = sd["smear_lambda"] * torch.sigmoid(x[:, :24] @ sd["smear_gate.weight"].T)
        x = torch.cat([x[:1], x[1:] + gate[1:] * x[:-1]])
    x0 = x

    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    angles = torch.outer(torch.arange(T).float(), inv_freq)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rotate(t):  # half split, by minus theta
        t1, t2 = t[..., :D // 2], t[..., D // 2:]
        return torch.cat([t1 * cos + t2 * sin, -t1 * sin + t2 * cos], dim=-1)

    short = math.ceil(seq_len / 4 / 128) * 128
    pattern = config["window_pattern"] if era != "A" else "L"
    pos = torch.arange(T)
    backout = None
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        if "resid_lambdas" in sd:
            x = sd["resid_lambdas"][i] * x + sd["x0_lambdas"][i] * x0
        xn = rms(x)
        q = (xn @ sd[p + "attn.c_q.weight"].T).view(T, H, D)
        k = (xn @ sd[p + "attn.c_k.weight"].T).view(T, Hkv, D)
        v = (xn @ sd[p + "attn.c_v.weight"].T).view(T, Hkv, D)
        if f"value_embeds.{i}.weight" in sd:
            w_gate = sd[p + "attn.ve_gate.weight"]
            channels = w_gate.shape[1]
            scale = 2.0 if channels == 32 else 3.0
            g = scale * torch.sigmoid(xn[:, :channels] @ w_gate.T)  # [T, Hkv]
            v = v + g[:, :, None] * sd[f"value_embeds.{i}.weight"][idx].view(T, Hkv, D)
        q, k = rms(rotate(q)) * qk_scale, rms(rotate(k)) * qk_scale
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        kind = "L" if i == n_layer - 1 else pattern[i % len(pattern)]
        w = seq_len if kind == "L" else short
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - w)  # keys p-w..p
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        y = torch.einsum("hts,shd->thd", probs, v).reshape(T, H * D)
        x = x + y @ sd[p + "attn.c_proj.weight"].T
        x = x + F.relu(rms(x) @ sd[p + "mlp.c_fc.weight"].T).square() @ sd[p + "mlp.c_proj.weight"].T
        if "backout_lambda" in sd and i == n_layer // 2:
            backout = x
    if backout is not None:
        x = x - sd["backout_lambda"] * backout
    logits = (rms(x) @ sd["lm_head.weight"].T)[:, :config["vocab_size"]]
    return 15.0 * torch.tanh(logits / 15.0)


def reference_greedy(state: dict, era: str, ids: list[int], steps: int):
    ids, tokens, logits = list(ids), [], []
    for _ in range(steps):
        last = reference_logits(state, era, ids)[-1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        ids.append(tokens[-1])
    return tokens, logits


def engine_greedy(llm: LLM, prompts: list[list[int]], steps: int):
    """Greedy through the engine (paged KV, scheduler, chunked prefill), with the logits of
    every row that sampled, per request."""
    captured: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def spy(batch):
        logits, rows, hidden = run(batch)
        for row, i in enumerate(rows.samplers):
            captured.append((batch.seqs[i].request_id, logits[row].clone()))
        return logits, rows, hidden

    llm.engine.runner.run = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    finally:
        llm.engine.runner.run = run
    return [(o.outputs[0].token_ids, [lg for rid, lg in captured if rid == o.request_id]) for o in outs]


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def encoding():
    return build_encoding()


@pytest.fixture(scope="session")
def tokenizer(encoding):
    return NanochatTokenizer(encoding)


@pytest.fixture(scope="session")
def states():
    return {era: random_state(era, seed=i) for i, era in enumerate(ERAS)}


@pytest.fixture(scope="session")
def era_roots(tmp_path_factory, encoding, states):
    """One base dir per era: <root>/base_checkpoints/d4/model_000100.pt, tokenizer/tokenizer.pkl."""
    roots = {}
    for era, state in states.items():
        root = tmp_path_factory.mktemp(f"nanochat_{era.replace('/', '')}")
        write_tokenizer(root, encoding)
        write_checkpoint(root, "base", "d4", 100, state)
        roots[era] = root
    return roots


@pytest.fixture(scope="session")
def chat_root(tmp_path_factory, encoding, states):
    """Era F: base (two steps; a second tag d12) and chatsft (compiled keys, 0-dim scalars,
    other weights), the layout the loader has to find its way through."""
    root = tmp_path_factory.mktemp("nanochat_chat")
    write_tokenizer(root, encoding)
    write_checkpoint(root, "base", "d4", 100, random_state("F", seed=10))
    write_checkpoint(root, "base", "d4", 200, states["F"])
    write_checkpoint(root, "base", "d12", 50, random_state("F", seed=11))  # d12 > d4 by number, not by name
    write_checkpoint(root, "chatsft", "d4", 300, random_state("F", seed=12, scalar_shape=()), compiled=True)
    return root


def prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT * 8)
    assert len(ids) >= n
    return ids[:n]


# ---------------------------------------------------------------------------------------------
# (1) the model against the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("era", ERAS)
def test_forward_matches_reference(era, states, era_roots, tokenizer):
    config, state, _, info = load_nanochat(era_roots[era])
    assert info["era"] == era and config.extra["era"] == era
    model = build_module(config, state)
    ids = prompt(tokenizer, 200)
    assert len(ids) > short_window(MODEL_CONFIG["sequence_len"]) + 1  # the short window slides
    with torch.no_grad():
        ours = model(ForwardBatch.whole(torch.tensor(ids)))
    ref = reference_logits(states[era], era, ids)
    assert ours.dtype == torch.float32 and ours.shape == (len(ids), MODEL_CONFIG["vocab_size"])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_features_matter(states, era_roots, tokenizer):
    """The fixture's values are not neutral: dropping any feature changes the logits."""
    ids = prompt(tokenizer, 160)
    full = reference_logits(states["F"], "F", ids)
    for drop in ("smear_gate.weight", "backout_lambda", "value_embeds.3.weight", "resid_lambdas"):
        state = {k: v for k, v in states["F"].items() if not k.startswith(drop)}
        assert (reference_logits(state, "F", ids) - full).abs().max() > 1e-2, drop
    assert (reference_logits(states["F"], "E", ids) - full).abs().max() > 1e-2  # rotary base, qk scale


def test_prev_ids_and_logits_indices(era_roots, tokenizer):
    """Chunks fed with prev_ids (what the runner passes) give the logits of a whole forward."""
    config, state, _, _ = load_nanochat(era_roots["F"])
    model = build_module(config, state)
    ids = torch.tensor(prompt(tokenizer, 40))
    with torch.no_grad():
        whole = model(ForwardBatch.whole(ids))
        rows = model(ForwardBatch.whole(ids, logits_indices=torch.tensor([3, 39])))
        prev = torch.cat([torch.tensor([-1]), ids[:-1]])
        explicit = model(ForwardBatch.whole(ids, prev_ids=prev))
        wrong = model(ForwardBatch.whole(ids, prev_ids=torch.full((40,), -1)))
    torch.testing.assert_close(rows, whole[[3, 39]], atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, whole, atol=0, rtol=0)
    assert (wrong - whole).abs().max() > 1e-2  # the smear does use the previous token
    with pytest.raises(ValueError, match="prev_ids"):
        model(ForwardBatch(ids[5:], torch.arange(5, 40)))


def test_sliding_past_sequence_len(states, era_roots):
    """max_position_embeddings up to 10x sequence_len: past it, the long window slides."""
    seq_len = MODEL_CONFIG["sequence_len"]
    config, state, _, info = load_nanochat(era_roots["F"], overrides={"max_position_embeddings": 2 * seq_len})
    assert config.max_position_embeddings == 2 * seq_len and info["max_position_embeddings"] == 2 * seq_len
    model = build_module(config, state)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (seq_len + 80,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ForwardBatch.whole(ids))
    torch.testing.assert_close(ours, reference_logits(states["F"], "F", ids.tolist()), atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="max_position_embeddings"):
        load_nanochat(era_roots["F"], overrides={"max_position_embeddings": 10 * seq_len + 1})


def test_overrides(era_roots, tokenizer, states):
    config, state, _, info = load_nanochat(era_roots["C/D"], overrides={"softcap": 20.0, "rope_theta": 5000.0,
                                                                       "qk_scale": 1.1})
    assert (info["softcap"], info["rope_theta"], info["qk_scale"]) == (20.0, 5000.0, 1.1)
    assert "softcap=20" in info["note"]
    config, state, _, _ = load_nanochat(era_roots["A"], overrides={"softcap": None})
    ids = prompt(tokenizer, 20)
    with torch.no_grad():
        raw = build_module(config, state)(ForwardBatch.whole(torch.tensor(ids)))
    capped = reference_logits(states["A"], "A", ids)
    torch.testing.assert_close(15.0 * torch.tanh(raw / 15.0), capped, atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="unknown nanochat override"):
        load_nanochat(era_roots["A"], overrides={"rotary": 1})


# ---------------------------------------------------------------------------------------------
# (2) the engine path: paged KV, prefill chunks, several sequences in one batch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("era,engine_args", [
    ("F", {}),
    ("F", dict(block_size=4, max_num_batched_tokens=7)),  # chunk boundaries inside the smear
    ("C/D", dict(block_size=4, max_num_batched_tokens=7)),
])
def test_engine_greedy_matches_reference(era, engine_args, states, era_roots, tokenizer):
    steps = 34
    llm = LLM(era_roots[era], **engine_args, **KV)
    assert llm.loaded.format == "nanochat" and isinstance(llm.tokenizer, NanochatTokenizer)
    ids = prompt(tokenizer, 110)  # + 34 generated: past the short window of 129 keys
    (tokens, logits), = engine_greedy(llm, [ids], steps)
    ref_tokens, ref_logits = reference_greedy(states[era], era, ids, steps)
    assert len(logits) == steps
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=lambda m, step=step: f"step {step}: {m}")
    assert tokens == ref_tokens


def test_engine_packs_sequences(states, era_roots, tokenizer):
    """Two prompts prefilled and decoded in the same forwards: prev_ids stay per sequence."""
    llm = LLM(era_roots["F"], block_size=4, max_num_batched_tokens=9, **KV)
    prompts = [prompt(tokenizer, 23), tokenizer.encode("日本語のテキスト 😀 and numbers 1234")]
    for (tokens, logits), ids in zip(engine_greedy(llm, prompts, 12), prompts):
        ref_tokens, ref_logits = reference_greedy(states["F"], "F", ids, 12)
        torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=1e-4, rtol=0)
        assert tokens == ref_tokens


def test_engine_bf16(states, era_roots, tokenizer):
    """Served in bf16: parameters and KV cache bf16, the learned scalars fp32, logits close."""
    llm = LLM(era_roots["F"], dtype="bfloat16", block_size=4, max_num_batched_tokens=7, **KV)
    model = llm.loaded.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and llm.engine.cache.dtype == torch.bfloat16
    assert model.resid_lambdas.dtype == model.smear_lambda.dtype == torch.float32
    ids = prompt(tokenizer, 40)
    (tokens, logits), = engine_greedy(llm, [ids], 4)
    _, ref_logits = reference_greedy(states["F"], "F", ids, 1)
    assert (logits[0] - ref_logits[0]).abs().max() < 0.5


def test_chat_generation_stops_at_assistant_end(era_roots):
    llm = LLM(era_roots["F"], **KV)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].prompt_token_ids[-1] == llm.tokenizer.special_ids["<|assistant_start|>"]
    assert llm.tokenizer.eos_token_ids == {llm.tokenizer.special_ids["<|assistant_end|>"], llm.tokenizer.bos_token_id}


# ---------------------------------------------------------------------------------------------
# (3) loading
# ---------------------------------------------------------------------------------------------

def test_load_paths(chat_root):
    _, _, _, info = load_nanochat(chat_root)  # base dir: chatsft preferred over base
    assert (info["source"], info["tag"], info["step"], info["era"]) == ("chatsft", "d4", 300, "F")
    _, _, _, info = load_nanochat(chat_root, source="base")
    assert (info["source"], info["tag"], info["step"]) == ("base", "d12", 50)  # largest d<N>
    _, _, _, info = load_nanochat(chat_root / "base_checkpoints", tag="d4")  # a *_checkpoints dir
    assert (info["source"], info["tag"], info["step"]) == ("base", "d4", 200)  # largest step
    _, _, _, info = load_nanochat(chat_root / "base_checkpoints" / "d4", step=100)  # a tag dir
    assert (info["source"], info["step"]) == ("base", 100)
    for path in (chat_root, chat_root / "base_checkpoints", chat_root / "base_checkpoints" / "d4"):
        assert detect_format(path) == "nanochat"
        assert isinstance(load_tokenizer(path), NanochatTokenizer)


def test_compiled_keys_and_scalar_shapes(chat_root):
    """The chatsft checkpoint has `_orig_mod.` keys and 0-dim scalars; both load."""
    raw = torch.load(chat_root / "chatsft_checkpoints/d4/model_000300.pt", weights_only=True)
    assert all(k.startswith("_orig_mod.") for k in raw)
    config, state, _, _ = load_nanochat(chat_root, dtype=torch.bfloat16)
    assert not any(k.startswith("_orig_mod.") for k in state)
    assert state["transformer.h.0.attn.c_q.weight"].dtype == torch.bfloat16
    assert state["resid_lambdas"].dtype == torch.float32 and state["smear_lambda"].shape == (1,)
    model = build_module(config, state)
    ids = torch.arange(1, 30)
    with torch.no_grad():
        out = model(ForwardBatch.whole(ids))
    ref = reference_logits(raw, "F", ids.tolist())
    assert (out - ref).abs().max() < 0.5  # bf16 weights and activations: close, not exact


def test_rl_checkpoint_without_step_is_preferred(tmp_path, encoding):
    write_tokenizer(tmp_path, encoding)
    write_checkpoint(tmp_path, "base", "d4", 100, random_state("F"))
    write_checkpoint(tmp_path, "chatsft", "d4", 100, random_state("F"))
    write_checkpoint(tmp_path, "chatrl", "d4", 60, random_state("F"), with_step=False)
    loaded = load_model(tmp_path)
    assert loaded.format == "nanochat" and loaded.config.extra["source"] == "chatrl"
    assert loaded.config.extra["step"] == 60


def test_tokenizer_next_to_checkpoint(tmp_path, encoding):
    folder = write_checkpoint(tmp_path / "elsewhere", "chatsft", "mytag", 7, random_state("B"))
    shutil.move(str(folder), tmp_path / "mytag")
    with pytest.raises(ModelLoadError, match="tokenizer.pkl"):
        load_nanochat(tmp_path / "mytag")
    (tmp_path / "mytag" / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
    _, _, _, info = load_nanochat(tmp_path / "mytag")
    assert (info["era"], info["tag"], info["step"], info["source"]) == ("B", "mytag", 7, None)


def _single_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_load_errors(tmp_path, encoding, era_roots):
    with pytest.raises(ModelLoadError):
        load_nanochat(tmp_path / "missing")
    empty = tmp_path / "empty"
    (empty / "base_checkpoints" / "d4").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="no checkpoints") as e:
        load_nanochat(empty)
    _single_line(e)

    def variant(name: str, state=None, config=None):
        root = tmp_path / name
        write_tokenizer(root, encoding)
        return root, write_checkpoint(root, "base", "d4", 1, state or random_state("F"), config=config)

    root, folder = variant("corrupt")
    (folder / "model_000001.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ModelLoadError, match="cannot load") as e:
        load_nanochat(root)
    _single_line(e)

    root, folder = variant("no_meta")
    (folder / "meta_000001.json").unlink()
    with pytest.raises(ModelLoadError, match="meta_000001.json"):
        load_nanochat(root)

    root, folder = variant("fields")
    meta = json.loads((folder / "meta_000001.json").read_text())
    del meta["model_config"]["n_head"]
    (folder / "meta_000001.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="lacks n_head") as e:
        load_nanochat(root)
    _single_line(e)

    state = random_state("E")
    state["transformer.h.1.attn.ve_gate.weight"] = torch.zeros(2, 20)
    state["transformer.h.3.attn.ve_gate.weight"] = torch.zeros(2, 20)
    with pytest.raises(ModelLoadError, match="unknown tensor layout") as e:
        load_model(variant("gate", state)[0])
    _single_line(e)

    state = random_state("F")
    state["transformer.h.0.attn.c_q.weight"] = torch.zeros(32, 64)
    with pytest.raises(ModelLoadError, match="unknown tensor layout.*c_q"):
        load_model(variant("shape", state)[0])

    state = random_state("F")
    state["transformer.h.9.attn.c_q.weight"] = torch.zeros(64, 64)
    with pytest.raises(ModelLoadError, match="unexpected transformer.h.9"):
        load_model(variant("extra", state)[0])

    state = random_state("F")
    del state["backout_lambda"]
    with pytest.raises(ModelLoadError, match="backout_lambda is missing"):
        load_model(variant("missing_tensor", state)[0])

    with pytest.raises(ModelLoadError, match="no step 5"):
        load_nanochat(era_roots["F"], step=5)
    with pytest.raises(ModelLoadError, match="no tag 'd9'"):
        load_nanochat(era_roots["F"], tag="d9")
    with pytest.raises(ModelLoadError, match="no chatrl_checkpoints"):
        load_nanochat(era_roots["F"], source="chatrl")


def test_weights_only_refuses_foreign_pickles(tmp_path, encoding):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    write_tokenizer(tmp_path, encoding)
    folder = write_checkpoint(tmp_path, "base", "d4", 1, random_state("F"))
    torch.save({"x": Evil()}, folder / "model_000001.pt")
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_nanochat(tmp_path)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------
# (4) tokenizer.pkl is read through a restricted unpickler
# ---------------------------------------------------------------------------------------------

class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalCall:
    def __reduce__(self):
        return (eval, ("1 + 1",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_tokenizer_pickle_protocols(tmp_path, encoding, protocol):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(encoding, protocol=protocol))
    tok = NanochatTokenizer.from_pickle(path)
    assert tok.encode(TEXT) == [tok.bos_token_id, *encoding.encode_ordinary(TEXT)]


def test_malicious_tokenizer_pickle(tmp_path, encoding):
    marker = tmp_path / "pwned"
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(ModelLoadError, match="something other than a tiktoken Encoding: posix.system") as e:
        NanochatTokenizer.from_pickle(path)
    _single_line(e)
    assert not marker.exists()

    path.write_bytes(pickle.dumps(_EvalCall()))
    with pytest.raises(ModelLoadError, match="builtins.eval"):
        NanochatTokenizer.from_pickle(path)

    # hidden inside an otherwise genuine Encoding state
    class Wrapped:
        def __reduce__(self):
            state = {"name": "x", "pat_str": encoding._pat_str, "special_tokens": encoding._special_tokens,
                     "mergeable_ranks": {b"a": _Evil(marker)}}
            return (type(encoding), (), state)

    path.write_bytes(pickle.dumps(Wrapped()))
    with pytest.raises(ModelLoadError, match="posix.system"):
        NanochatTokenizer.from_pickle(path)
    assert not marker.exists()

    path.write_bytes(pickle.dumps({"not": "an encoding"}))
    with pytest.raises(ModelLoadError, match="not a tiktoken Encoding"):
        NanochatTokenizer.from_pickle(path)
    path.write_bytes(pickle.dumps(encoding)[:100])
    with pytest.raises(ModelLoadError, match="not a readable pickle"):
        NanochatTokenizer.from_pickle(path)


# ---------------------------------------------------------------------------------------------
# (5) the tokenizer
# ---------------------------------------------------------------------------------------------

def test_encode_decode(tokenizer, encoding):
    ids = tokenizer.encode(TEXT)
    assert ids[0] == tokenizer.bos_token_id and ids[1:] == encoding.encode_ordinary(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|>" + TEXT
    assert tokenizer.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tokenizer.vocab_size == MODEL_CONFIG["vocab_size"]
    assert list(tokenizer.special_ids.values()) == list(range(tokenizer.vocab_size - 9, tokenizer.vocab_size))
    for i in range(tokenizer.vocab_size):
        assert tokenizer.token_to_id(tokenizer.id_to_token(i)) == i
    assert tokenizer.is_special(tokenizer.eos_token_id) and not tokenizer.is_special(5)
    assert tokenizer.decode([0xffff, 104, 105]) == "hi"  # ids past the vocabulary decode to nothing


def test_typed_special_tokens_stay_text(tokenizer):
    text = "<|assistant_end|> and <|bos|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert not any(tokenizer.is_special(i) for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False, parse_special=True)[0] == tokenizer.eos_token_id
    # ... and inside a conversation too
    ids, _ = tokenizer.render_conversation([{"role": "user", "content": text}])
    assert sum(tokenizer.is_special(i) for i in ids) == 3  # bos, user_start, user_end


def test_render_conversation(tokenizer):
    s, enc = tokenizer.special_ids, (lambda t: tokenizer.encode(t, add_special_tokens=False))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12*3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me compute. "},
            {"type": "python", "text": "12*3"},
            {"type": "python_output", "text": "36"},
            {"type": "text", "text": "It is 36."},
        ]},
        {"role": "user", "content": "Thanks 日本"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    expected = [
        ([s["<|bos|>"]], 0),
        ([s["<|user_start|>"]], 0), (enc("Be brief.\n\nWhat is 12*3?"), 0), ([s["<|user_end|>"]], 0),
        ([s["<|assistant_start|>"]], 0),
        (enc("Let me compute. "), 1),
        ([s["<|python_start|>"]], 1), (enc("12*3"), 1), ([s["<|python_end|>"]], 1),
        ([s["<|output_start|>"]], 0), (enc("36"), 0), ([s["<|output_end|>"]], 0),
        (enc("It is 36."), 1), ([s["<|assistant_end|>"]], 1),
        ([s["<|user_start|>"]], 0), (enc("Thanks 日本"), 0), ([s["<|user_end|>"]], 0),
        ([s["<|assistant_start|>"]], 0), (enc("You're welcome."), 1), ([s["<|assistant_end|>"]], 1),
    ]
    ids, mask = tokenizer.render_conversation(messages)
    assert ids == [t for part, _ in expected for t in part]
    assert mask == [m for part, m in expected for _ in part]

    prompt_ids = tokenizer.encode_chat(messages[:4])
    assert prompt_ids == ids[:len(prompt_ids) - 1] + [s["<|assistant_start|>"]]
    assert tokenizer.render_for_completion(messages) == prompt_ids
    assert tokenizer.apply_chat_template(messages[:2]) == (
        "<|bos|><|user_start|>Be brief.\n\nWhat is 12*3?<|user_end|><|assistant_start|>")


@pytest.mark.parametrize("messages,match", [
    ([{"role": "assistant", "content": "hi"}], "message 0 has role 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate user and assistant"),
    ([{"role": "system", "content": "s"}], "followed by a user message"),
    ([{"role": "user", "content": 3}], "content must be"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image"}]}], "assistant parts"),
    ([], "non-empty"),
])
def test_render_errors(tokenizer, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        tokenizer.encode_chat(messages)


def test_encode_chat_needs_a_user_turn_last(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="last message"):
        tokenizer.encode_chat(messages)
    assert tokenizer.encode_chat(messages, add_generation_prompt=False)[-1] == tokenizer.eos_token_id


def test_streaming_detokenization(tokenizer):
    text = "日本語のテキストと中文文本。Emoji: 😀 🎉 👍🏽 ❤️ 龍🐉 Ça va"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the test only means something if tokens split characters
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    # specials in the stream vanish when skipped
    detok = IncrementalDetokenizer(tokenizer)
    stream = [tokenizer.special_ids["<|python_start|>"], *ids, tokenizer.eos_token_id]
    assert "".join(detok.add(i) for i in stream) + detok.flush() == text
