"""Hostile model files and chat templates: each must fail with a one-line error, quickly and
before any allocation proportional to the lying field (a size field is checked against the
tensors present and the file size first)."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from nanoinfer.errors import InvalidRequestError, ModelLoadError
from nanoinfer.loaders.gguf import read_gguf_metadata
from nanoinfer.models.builder import load_model
from nanoinfer.tokenizer import Tokenizer
from nanoinfer.tokenizer import chat_template as chat_template_module

from gguf_export import write_gguf_from_hf
from nanochat_fixtures import build_encoding, random_state, write_checkpoint, write_tokenizer

V = gguf.GGUFValueType


@contextmanager
def fails_fast(error: type[Exception], match: str, seconds: float = 5.0) -> Iterator[None]:
    t0 = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        yield
    assert time.perf_counter() - t0 < seconds
    assert "\n" not in str(info.value)


def hostile_gguf(make_hf_model, tokenizer_dir: Path, path: Path, monkeypatch,
                 **overrides: tuple[Any, gguf.GGUFValueType]) -> Path:
    """The tiny Llama as GGUF with metadata values replaced (key -> (value, type))."""
    model, _ = make_hf_model("llama")
    add = gguf.GGUFWriter.add_key_value

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key in overrides:
            val, vtype = overrides[key]
        add(self, key, val, vtype, sub_type)

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_key_value", add_key_value)
        return write_gguf_from_hf(model, tokenizer_dir, path)


def hostile_hf(make_hf_model, tmp_path: Path, edit: Callable[[dict], Any]) -> Path:
    """A copy of the tiny Llama folder whose config.json is edit(config)."""
    _, src = make_hf_model("llama")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(config)))
    return path


# ------------------------------------------------------------------------------------ GGUF

def loads_small(path: Path, context: int) -> None:
    """A huge declared context costs nothing at load: rotary tables grow with the positions
    served, and the engine's window is what its KV pool holds."""
    import resource

    from nanoinfer import LLM, SamplingParams

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    llm = LLM(path, kv_cache_memory=1 << 20)
    assert time.perf_counter() - t0 < 5
    assert llm.loaded.config.max_position_embeddings == context
    assert llm.max_model_len <= (1 << 20) // llm.loaded.config.kv_bytes_per_token(4)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert len(llm.generate([5, 6, 7], params)[0].outputs[0].token_ids) == 16


def test_gguf_huge_context_length(make_hf_model, tiny_tokenizer_dir, tmp_path, monkeypatch):
    path = hostile_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "m.gguf", monkeypatch,
                        **{"llama.context_length": (200_000_000, V.UINT32)})
    loads_small(path, 200_000_000)
    path = hostile_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "n.gguf", monkeypatch,
                        **{"llama.context_length": (2**40, V.UINT64)})
    with fails_fast(ModelLoadError, "context_length"):
        load_model(path)


@pytest.mark.parametrize("count, match", [(4_294_967_295, "block_count must be an integer"),
                                          (100_000_000, "block_count 100000000 does not match the 2 layers"),
                                          (1, "block_count 1 does not match the 2 layers")])
def test_gguf_block_count(count, match, make_hf_model, tiny_tokenizer_dir, tmp_path, monkeypatch):
    path = hostile_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "m.gguf", monkeypatch,
                        **{"llama.block_count": (count, V.UINT32)})
    with fails_fast(ModelLoadError, match):
        load_model(path)


@pytest.mark.parametrize("key, value", [
    ("llama.embedding_length", ("64", V.STRING)),
    ("llama.embedding_length", (True, V.BOOL)),
    ("llama.attention.head_count", (0, V.UINT32)),
    ("llama.feed_forward_length", (-128, V.INT32)),
    ("llama.vocab_size", (-1, V.INT32)),
    ("llama.rope.freq_base", ("fast", V.STRING)),
])
def test_gguf_bad_field(key, value, make_hf_model, tiny_tokenizer_dir, tmp_path, monkeypatch):
    path = hostile_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "m.gguf", monkeypatch, **{key: value})
    with fails_fast(ModelLoadError, key.replace(".", r"\.")):
        load_model(path)


def _raw_gguf(path: Path, key: bytes, value: bytes) -> Path:
    """A GGUF v3 file with no tensors and one metadata item (value: type id + payload)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + value)
    return path


def test_gguf_deeply_nested_array(tmp_path):
    depth = 100_000
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    path = _raw_gguf(tmp_path / "nested.gguf", b"x", value)
    with fails_fast(ModelLoadError, "nested"):
        read_gguf_metadata(path)
    with fails_fast(ModelLoadError, "nested"):
        load_model(path)


@pytest.mark.parametrize("elem, count", [(8, 2**40), (9, 2**40), (8, 2**64 - 1), (6, 2**61)])
def test_gguf_array_count_beyond_the_file(elem, count, tmp_path):
    path = _raw_gguf(tmp_path / "big.gguf", b"x", struct.pack("<IIQ", 9, elem, count) + b"\0" * 64)
    with fails_fast(ModelLoadError, "corrupt"):
        read_gguf_metadata(path)


def test_gguf_string_length_beyond_the_file(tmp_path):
    path = _raw_gguf(tmp_path / "s.gguf", b"x", struct.pack("<IQ", 8, 2**62) + b"abc")
    with fails_fast(ModelLoadError, "corrupt"):
        read_gguf_metadata(path)


def _tensor_infos(path: Path) -> dict[str, tuple[int, int, int]]:
    """Each tensor's (byte position of its type id, of its offset, the offset) in the file's header."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        f = t.field
        type_pos = f.offset + sum(int(p.nbytes) for p in f.parts[:4])
        out[t.name] = (type_pos, type_pos + 4, int(f.parts[5][0]))
    return out


def _patch(path: Path, pos: int, fmt: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, pos, value)
    path.write_bytes(bytes(data))


@pytest.fixture
def q4_1_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path) -> Path:
    model, _ = make_hf_model("llama")
    return write_gguf_from_hf(model, tiny_tokenizer_dir, tmp_path / "q41.gguf", tensor_type="Q4_1")


def test_gguf_tensor_offset_off_the_alignment(q4_1_gguf):
    infos = _tensor_infos(q4_1_gguf)
    name = list(infos)[3]
    _, offset_pos, offset = infos[name]
    _patch(q4_1_gguf, offset_pos, "<Q", offset + 1)
    with fails_fast(ModelLoadError, f"tensor '{name}' has offset {offset + 1}, expected {offset}"):
        load_model(q4_1_gguf)


def test_gguf_two_tensors_at_one_offset(q4_1_gguf):
    infos = _tensor_infos(q4_1_gguf)
    first, second = list(infos)[1:3]
    _patch(q4_1_gguf, infos[second][1], "<Q", infos[first][2])
    with fails_fast(ModelLoadError, f"tensor '{second}' has offset {infos[first][2]}, expected {infos[second][2]}"):
        load_model(q4_1_gguf)


@pytest.mark.parametrize("which", ["first", "last", "all"])
def test_gguf_q4_1_retyped_as_q4_0(which, q4_1_gguf):
    """Q4_0 blocks are 18 bytes, Q4_1's 20: a retyped tensor no longer fills its place in the file."""
    infos = _tensor_infos(q4_1_gguf)
    retyped = [n for n, t in zip(infos, gguf.GGUFReader(q4_1_gguf).tensors)
               if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    assert len(retyped) > 2
    chosen = {"first": retyped[:1], "last": retyped[-1:], "all": retyped}[which]
    for name in chosen:
        _patch(q4_1_gguf, infos[name][0], "<I", int(gguf.GGMLQuantizationType.Q4_0))
    with fails_fast(ModelLoadError, "(has offset .*, expected|bytes follow its .* Q4_0 data)"):
        load_model(q4_1_gguf)


def test_gguf_layout_error_is_one_cli_line(q4_1_gguf):
    infos = _tensor_infos(q4_1_gguf)
    name = list(infos)[2]
    _patch(q4_1_gguf, infos[name][1], "<Q", infos[name][2] + 32)
    proc = subprocess.run([sys.executable, "-m", "nanoinfer", "generate", "hi", "--model", str(q4_1_gguf)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: corrupt or truncated GGUF file") and proc.stderr.count("\n") == 1
    assert f"tensor '{name}' has offset" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ HF

def test_hf_huge_max_position_embeddings(make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path, lambda c: {**c, "max_position_embeddings": 1_000_000_000})
    loads_small(path, 1_000_000_000)
    path = hostile_hf(make_hf_model, tmp_path / "b", lambda c: {**c, "max_position_embeddings": 10**12})
    with fails_fast(ModelLoadError, "max_position_embeddings"):
        load_model(path)


def test_hf_huge_num_hidden_layers(make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path, lambda c: {**c, "num_hidden_layers": 1_000_000_000})
    with fails_fast(ModelLoadError, "num_hidden_layers 1000000000 does not match the 2 layers"):
        load_model(path)


@pytest.mark.parametrize("config", [[], None, "llama", 3])
def test_hf_config_not_an_object(config, make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path, lambda c: config)
    with fails_fast(ModelLoadError, "config.json.*object"):
        load_model(path)


@pytest.mark.parametrize("patch, match", [
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": True}, "num_key_value_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"head_dim": -16}, "head_dim"),
    ({"rope_parameters": {"rope_theta": "high", "rope_type": "default"}}, "rope_theta"),
    ({"rope_parameters": "default"}, "rope_parameters"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, "rope_scaling.factor"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"use_sliding_window": True, "sliding_window": "8"}, "sliding_window"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
])
def test_hf_bad_field(patch, match, make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path, lambda c: {**c, **patch})
    with fails_fast(ModelLoadError, match):
        load_model(path)


def test_hf_sizes_that_contradict_the_tensors(make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path, lambda c: {**c, "vocab_size": 10**9})
    with fails_fast(ModelLoadError, "vocab_size"):
        load_model(path)


def test_hf_model_type_without_architectures(make_hf_model, tmp_path):
    _, src = make_hf_model("qwen2")
    reference = load_model(src)
    path = tmp_path / "model"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(path)
    assert loaded.config.extra.pop("hf_config") == config  # the file as written, for the family's module
    reference.config.extra.pop("hf_config")
    assert loaded.config == reference.config
    ours, theirs = loaded.model.state_dict(), reference.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_hf_unknown_model_type(make_hf_model, tmp_path):
    path = hostile_hf(make_hf_model, tmp_path,
                      lambda c: {k: v for k, v in c.items() if k != "architectures"} | {"model_type": "gpt2"})
    with fails_fast(ModelLoadError, "model_type 'gpt2'.*supported.*llama"):
        load_model(path)


# ------------------------------------------------------------------------------------ nanochat

@pytest.mark.parametrize("field, value, match", [("n_layer", 10**9, "n_layer 1000000000"),
                                                ("sequence_len", 2**40, "sequence_len must be an integer")])
def test_nanochat_huge_field(field, value, match, tmp_path):
    write_tokenizer(tmp_path, build_encoding())
    write_checkpoint(tmp_path, "base", "d4", 1, random_state("F"), config={field: value})
    with fails_fast(ModelLoadError, match):
        load_model(tmp_path)


def test_nanochat_huge_sequence_len_loads_small(tmp_path):
    write_tokenizer(tmp_path, build_encoding())
    write_checkpoint(tmp_path, "base", "d4", 1, random_state("F"), config={"sequence_len": 10**9})
    loads_small(tmp_path, 10**9)


# ------------------------------------------------------------------------------------ chat templates

def _templated(tiny_tokenizer_dir: Path, tmp_path: Path, template: str) -> Tokenizer:
    path = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, path)
    (path / "chat_template.jinja").write_text(template)
    return Tokenizer.from_hf_folder(path)


SIZE, TIME = "would build .* of length|output is over", "rendering took over"
HOSTILE_TEMPLATES = {  # name: (template, what the error says)
    "repeat": ("{{ 'x' * 10**10 }}", SIZE),
    "repeat_list": ("{{ ([1] * 10**10) | length }}", SIZE),
    "range": ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    "power": ("{{ 10**(10**10) }}", "integer over"),
    "float_power": ("{{ 10.0**(10**10) }}", "overflow"),
    "concat_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s | length }}", SIZE),
    "plus_doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s | length }}", SIZE),
    "output": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", SIZE),
    "center_filter": ("{{ 'x' | center(10**10) }}", SIZE),
    "center_method": ("{{ 'x'.center(10**10) }}", SIZE),
    "format_method": ("{{ '{:>9999999999}'.format(1) }}", SIZE),
    "printf": ("{{ '%09999999999d' % 1 }}", SIZE),
    "format_filter": ("{{ '%9999999999s' | format('x') }}", SIZE),
    "indent_filter": ("{{ ('x\n' * 1000) | indent(10**7) }}", SIZE),
    "replace": ("{% set s = 'x' * 100000 %}{{ s.replace('', s) | length }}", SIZE),
    "join": ("{% set s = 'x' * 100000 %}{{ s.join(s) | length }}", SIZE),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    "busy_loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", TIME),
    "macro_fanout": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                     TIME),
    "string_loops": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", TIME),
    "recursive_loop": ("{% set ns = namespace(t=[]) %}{% for i in range(60) %}{% set ns.t = [ns.t, ns.t] %}"
                       "{% endfor %}{% for x in [ns.t] recursive %}{{ loop(x) }}{% endfor %}", TIME),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_template(name, tiny_tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(chat_template_module, "_TEMPLATE_SECONDS", 0.5)  # the default, 2 s, works the same
    template, match = HOSTILE_TEMPLATES[name]
    tok = _templated(tiny_tokenizer_dir, tmp_path, template)
    with fails_fast(InvalidRequestError, f"^chat template error: .*({match})"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bounded_template_still_renders_large_chats(tiny_tokenizer_dir, tmp_path):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{% endfor %}{{ '-' * 1000 }}{{ ('%5d' % 42) ~ '{:>4}'.format(7) }}{{ 'a' | center(9) }}")
    tok = _templated(tiny_tokenizer_dir, tmp_path, template)
    content = "word " * 400_000  # 2 MB of prompt
    text = tok.apply_chat_template([{"role": "user", "content": content}] * 2)
    assert text.count(content) == 2 and text.endswith("-" * 1000 + "   42   7    a    ")


# ------------------------------------------------------------------------------------ memory limits
# Before: the default pool was at least one full context and at most a quarter of MemAvailable,
# mapped whole: under `prlimit --as=4GiB` the default model died with OSError ENOMEM and a
# traceback, and a file declaring a 2e8-token context died the same way without any limit.

def _cli(args: list[str], prefix: list[str] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "nanoinfer", *args], capture_output=True, text=True,
                          timeout=300)


def test_default_model_runs_under_an_address_space_limit():
    proc = _cli(["generate", "hi", "--max-tokens", "4", "--temperature", "0"], ["prlimit", f"--as={4 << 30}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # a window asked for that the limit leaves no room for: refused in one line naming the limit
    from nanoinfer.engine.memory import GroupCost, MemoryBudget, plan_kv_pool
    tight = MemoryBudget(available=20 << 30, cgroup=None, address_space=(1 << 30) + (128 << 20))
    with pytest.raises(InvalidRequestError, match=r"max_model_len=8192 does not fit: the KV pool holds \d+ tokens "
                                                  r"\(64 MiB, set by the address-space limit") as e:
        plan_kv_pool([GroupCost(23_040)], 16, 8192, 8192, None, 64, tight)
    assert "\n" not in str(e.value)
    clamped = plan_kv_pool([GroupCost(23_040)], 16, 8192, None, None, 64, tight)  # the model's own window: clamped
    assert clamped.max_model_len == 2912 and "clamped to 2912" in clamped.note


def test_a_context_that_does_not_fit_is_clamped_in_one_line(make_hf_model, tiny_tokenizer_dir, tmp_path, monkeypatch):
    path = hostile_gguf(make_hf_model, tiny_tokenizer_dir, tmp_path / "m.gguf", monkeypatch,
                        **{"llama.context_length": (200_000_000, V.UINT32)})
    proc = _cli(["generate", "Hello", "--model", str(path), "--max-tokens", "4", "--ignore-eos", "--no-echo"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if "context window clamped" in line]
    assert len(notes) == 1 and "the model declares 200000000" in notes[0] and "Traceback" not in proc.stderr


def test_memory_budget_reads_cgroup_limits(tmp_path):
    from nanoinfer.engine.memory import cgroup_headroom

    root = tmp_path / "cg"
    (root / "app" / "worker").mkdir(parents=True)
    (root / "app" / "memory.max").write_text("1073741824\n")  # 1 GiB on the parent
    (root / "app" / "memory.current").write_text("268435456\n")
    (root / "app" / "worker" / "memory.max").write_text("max\n")
    (root / "app" / "worker" / "memory.current").write_text("1000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/app/worker\n")
    assert cgroup_headroom(root, proc) == (1 << 30) - (1 << 28)
    v1 = tmp_path / "v1"
    (v1 / "memory" / "box").mkdir(parents=True)
    (v1 / "memory" / "box" / "memory.limit_in_bytes").write_text(str(512 << 20))
    (v1 / "memory" / "box" / "memory.usage_in_bytes").write_text(str(12 << 20))
    proc.write_text("5:cpu,cpuacct:/box\n4:memory:/box\n")
    assert cgroup_headroom(v1, proc) == 500 << 20
    proc.write_text("0::/\n")
    assert cgroup_headroom(tmp_path / "none", proc) is None
