"""Tool turns through chat templates of every family's shape (issue 26): an assistant turn with
tool calls and `content: null` (or none), tool results, and parallel calls render, whether the
template lists tools itself (native) or the server writes them in (injected).

The templates below are written here in the shapes the families' own templates take (what they
read of a message, how they list tools, what they refuse), not copied from the model files."""
from __future__ import annotations

import json
import shutil

import pytest

from nanoinfer.errors import InvalidRequestError
from nanoinfer.tokenizer import Tokenizer

CHATML_NO_TOOLS = (  # SmolLM2's shape
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HERMES = (  # Qwen 2.5's shape: tools in the system turn, calls and results as tagged blocks
    "{% if tools %}<|im_start|>system\\n# Tools\\n<tools>{% for t in tools %}\\n{{ t | tojson }}{% endfor %}\\n</tools>"
    "<|im_end|>\\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\\n<tool_response>\\n"
    "{{ m.content }}\\n</tool_response><|im_end|>\\n{% elif m.role == 'assistant' %}<|im_start|>assistant\\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}\\n<tool_call>\\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\\n</tool_call>"
    "{% endfor %}<|im_end|>\\n{% else %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
LLAMA3 = (  # Llama 3.1's shape: tools in the first user turn, one JSON call per turn, results as ipython
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls at once!') }}"
    "{% endif %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"{{ m.tool_calls[0].function.name }}\", "
    "\"parameters\": {{ m.tool_calls[0].function.arguments | tojson }}}<|eot_id|>{% elif m.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\\n\\n{{ m.content }}<|eot_id|>{% else %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\\n\\n{% if loop.first and tools %}Functions:\\n"
    "{% for t in tools %}{{ t | tojson }}\\n{% endfor %}{% endif %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{% endif %}")
GEMMA = (  # Gemma's shape: no tools, system folded into the first user turn, roles must alternate
    "{{ bos_token }}{% if messages[0].role == 'system' %}{% set first = messages[0].content + '\\n\\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\\n{{ (first if loop.first else '') + "
    "m.content | trim }}<end_of_turn>\\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\\n{% endif %}")
MISTRAL = (  # Mistral v3's shape: [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] lists
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}{% elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]{% elif m.role == 'assistant' %}"
    "{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
PHI3 = (  # Phi-3's shape: no tools, message['content'] read as is
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

TEMPLATES = {"chatml-no-tools": (CHATML_NO_TOOLS, False), "hermes": (HERMES, True), "llama3": (LLAMA3, True),
             "gemma": (GEMMA, False), "mistral": (MISTRAL, True), "phi3": (PHI3, False)}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
         for name in ("get_weather", "get_time")]


def call(i: int, name: str, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}


def conversation(content_null: bool, parallel: bool) -> list[dict]:
    calls = [call(1, "get_weather", "Paris")] + ([call(2, "get_time", "Paris")] if parallel else [])
    turn = {"role": "assistant", "tool_calls": calls}
    if content_null:
        turn["content"] = None
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time in Paris?"},
            turn, *({"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"} for i, c in enumerate(calls))]


@pytest.fixture(scope="module")
def tokenizers(tiny_tokenizer_dir, tmp_path_factory):
    out = {}
    for name, (template, _) in TEMPLATES.items():
        path = tmp_path_factory.mktemp(name)
        for f in tiny_tokenizer_dir.iterdir():
            shutil.copy(f, path / f.name)
        (path / "chat_template.jinja").write_text(template)
        out[name] = Tokenizer.from_hf_folder(path)
    return out


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("content_null", [True, False], ids=["null-content", "no-content"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel-calls"])
def test_tool_turns_render_in_every_template_shape(tokenizers, name, content_null, parallel):
    from nanoinfer.server.protocol import ChatMessage, message_dicts
    from nanoinfer.server.serving import template_input

    tok, native = tokenizers[name], TEMPLATES[name][1]
    assert tok.native_tools == native
    messages = message_dicts([ChatMessage.model_validate(m) for m in conversation(content_null, parallel)])
    messages, tools = template_input(tok, messages, TOOLS)  # what the server hands the template
    if name == "llama3" and parallel:  # the template's own rule: one call a turn
        with pytest.raises(InvalidRequestError, match="single tool-calls"):
            tok.apply_chat_template(messages, tools=tools)
        return
    text = tok.apply_chat_template(messages, tools=tools)
    assert "None" not in text  # a null content never renders as the word
    assert "get_weather" in text and "Paris" in text and "result 0" in text
    if parallel:
        assert "get_time" in text and "result 1" in text
    if native:
        assert "<tool_call>\n{\"name\"" not in text or name == "hermes"  # the template's own format
    else:  # written in by the server: the tools' schemas, the calls and the results as tagged blocks
        assert json.dumps(TOOLS[0]) in text and json.dumps(TOOLS[1]) in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<tool_response>\nresult 0\n</tool_response>" in text
        assert text.index("Be brief.") < text.index("# Tools")  # after the caller's own system text


def test_injected_tools_without_a_system_message_get_one(tokenizers):
    from nanoinfer.server.serving import template_input

    tok = tokenizers["chatml-no-tools"]
    messages, tools = template_input(tok, [{"role": "user", "content": "Hi"}], TOOLS)
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[0]) in text
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "# Tools" not in plain
