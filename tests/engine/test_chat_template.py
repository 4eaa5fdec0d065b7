"""Tests for engine.chat_template.

Unmarked tests render templates given as text (including the embedded model's template,
copied here as a fixture) and need no weights. `model` + `reference` tests compare with
transformers' `apply_chat_template` on the embedded GGUF.
"""

from __future__ import annotations

import json
import re

import pytest

from engine.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

# SmolLM2-135M-Instruct's template, as stored in its GGUF.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? Answer in 日本語 😀"},
]

# A tool-aware template in the style of recent instruction models.
TOOLS_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n' }}
{%- for tool in tools %}
{{- tool | tojson }}{{ '\\n' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}
{{- '<|im_start|>assistant\\n' }}
{%- for call in message.tool_calls %}
{{- '<tool_call>' + (call.function | tojson(sort_keys=True)) + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def smollm2_meta(template: str | None = SMOLLM2_TEMPLATE) -> dict:
    meta = {
        "tokenizer.ggml.tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return meta


def test_smollm2_template_renders_chatml():
    tpl = ChatTemplate.from_gguf_metadata(smollm2_meta())
    assert tpl.render(CONVERSATION) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3? Answer in 日本語 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_add_generation_prompt_and_default_system():
    tpl = ChatTemplate.from_gguf_metadata(smollm2_meta())
    user = [{"role": "user", "content": "Hi"}]
    assert tpl.render(user, add_generation_prompt=False) == DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n"
    assert tpl.render(user).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_bos_eos_variables():
    tpl = ChatTemplate.from_gguf_metadata(smollm2_meta("{{ bos_token }}|{{ eos_token }}"))
    assert tpl.render([]) == "<|im_start|>|<|im_end|>"


def test_fallback_is_chatml():
    tpl = ChatTemplate.from_gguf_metadata(smollm2_meta(template=None))
    assert tpl.spec.is_fallback and tpl.source == CHATML_TEMPLATE
    assert tpl.render([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]
    assert tpl.render(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_content_parts_reach_the_template_untouched():
    tpl = ChatTemplate.from_source("{{ messages[0].content | tojson }}")
    parts = [{"type": "text", "text": "héllo <b>"}]
    assert json.loads(tpl.render([{"role": "user", "content": parts}])) == parts


def test_tools_template():
    tpl = ChatTemplate.from_source(TOOLS_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18"},
    ]
    out = tpl.render(messages, tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\n# Tools\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n")
    assert "°C" in out  # tojson keeps non-ASCII as is
    assert '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>' in out
    assert out.endswith("<|im_start|>tool\n18<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in tpl.render(messages[:1])


def test_tool_use_named_template_is_chosen_with_tools():
    meta = smollm2_meta("plain") | {"tokenizer.chat_template.tool_use": "with {{ tools | length }} tools"}
    tpl = ChatTemplate.from_gguf_metadata(meta)
    assert tpl.render([]) == "plain"
    assert tpl.render([], tools=[WEATHER_TOOL]) == "with 1 tools"


def test_extra_variables_and_helpers():
    tpl = ChatTemplate.from_source(
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{{ strftime_now('%Y') }}|{{ {'k': '<é>'} | tojson }}|{{ [1, 2] | tojson(indent=1) }}"
    )
    out = tpl.render([], enable_thinking=False)
    assert re.fullmatch(r'/no_think \d{4}\|\{"k": "<é>"\}\|\[\n 1,\n 2\n\]', out), out


def test_loop_controls_and_trim_blocks():
    tpl = ChatTemplate.from_source(
        "{% for m in messages %}\n"
        "  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "  {% if m.role == 'stop' %}{% break %}{% endif %}\n"
        "{{ m.content }};\n"
        "{% endfor %}"
    )
    msgs = [{"role": "a", "content": "1"}, {"role": "skip", "content": "2"}, {"role": "a", "content": "3"},
            {"role": "stop", "content": "4"}, {"role": "a", "content": "5"}]
    assert tpl.render(msgs) == "1;\n3;\n"


def test_generation_block_renders_body():
    tpl = ChatTemplate.from_source("{% generation %}A{{ 1 + 1 }}{% endgeneration %}")
    assert tpl.render([]) == "A2"


def test_raise_exception_gives_chat_template_error():
    tpl = ChatTemplate.from_source(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    )
    assert tpl.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        tpl.render([{"role": "assistant", "content": ""}])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__len__() }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_blocks_dunder_access(source):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate.from_source(source).render([{"role": "user", "content": "x"}])


def test_sandbox_is_immutable():
    tpl = ChatTemplate.from_source("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        tpl.render(messages)
    assert len(messages) == 1


def test_syntax_and_runtime_errors_are_clear():
    with pytest.raises(ChatTemplateError, match=r"does not compile: .*line 1"):
        ChatTemplate.from_source("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate.from_source("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        ChatTemplate.from_source("{{ nothing.attr }}").render([])


# --- reference: transformers' apply_chat_template on the embedded model -----------------------

@pytest.fixture(scope="module")
def embedded(smollm2_metadata, smollm2_hf_tokenizer):
    return smollm2_metadata, smollm2_hf_tokenizer


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello!"}],
    CONVERSATION,
    [{"role": "user", "content": "Line one\nline two\n\n  indented\ttab"},
     {"role": "assistant", "content": "<b>ok</b> & done"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "emoji 👨‍👩‍👧 ‘quotes’"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_embedded_template_matches_transformers(embedded, messages, add_generation_prompt):
    meta, ref = embedded
    tpl = ChatTemplate.from_gguf_metadata(meta)
    assert tpl.source == SMOLLM2_TEMPLATE
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tpl.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.model
@pytest.mark.reference
def test_tools_template_matches_transformers(embedded):
    _, ref = embedded
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    expected = ref.apply_chat_template(messages, tools=[WEATHER_TOOL], chat_template=TOOLS_TEMPLATE,
                                       tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_source(TOOLS_TEMPLATE).render(messages, tools=[WEATHER_TOOL]) == expected
