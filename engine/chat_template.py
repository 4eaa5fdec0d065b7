"""Chat templates: a conversation (list of messages) -> prompt text, from the GGUF's jinja template.

Contract
    tpl = ChatTemplate.from_gguf_metadata(meta)   # meta: GGUF key -> python value
    tpl.render(messages, add_generation_prompt=True, tools=None, **extra) -> str

The template is the model's own (`tokenizer.chat_template`), rendered the way Hugging
Face's `apply_chat_template` renders it, because that is what templates are written
against:

* a sandboxed jinja2 environment (`ImmutableSandboxedEnvironment`: no access to
  private or dunder attributes, no mutating methods such as `list.append`), with
  `trim_blocks` and `lstrip_blocks`, and the loop controls `{% break %}` and
  `{% continue %}`;
* variables `messages`, `add_generation_prompt`, `tools` (None when absent),
  `bos_token`, `eos_token`, plus any `extra` keyword (for example
  `enable_thinking`);
* `raise_exception(message)`, `strftime_now(format)`, and a `tojson` filter that
  writes non-ASCII characters as they are (`ensure_ascii=False`) and accepts
  `indent`, `separators` and `sort_keys`;
* the `{% generation %}...{% endgeneration %}` block that training templates use to
  mark assistant text; here it only renders its body.

Messages go to the template untouched: `content` may be a string or a list of parts
such as `{"type": "text", "text": ...}`; the template decides what to do with them.

If the file has no template, `CHATML_TEMPLATE` is used (see there). If the file has
a named `tool_use` template (`tokenizer.chat_template.tool_use`) it is used when
tools are passed, as transformers does.

Any failure while compiling or rendering (a syntax error, `raise_exception`, a
sandbox violation, a type error inside the template) raises `ChatTemplateError`
whose message says what went wrong.

It does not tokenize, validate message schemas, parse model output, or render tool
calls in a model-specific syntax beyond what the template itself does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
KEY_CHAT_TEMPLATE_NAMED = "tokenizer.chat_template."  # + name, e.g. "tool_use"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"

# Used when the GGUF carries no template. ChatML is the format most instruction-tuned
# models of this size were trained on, and it is unambiguous to parse: each message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an
# assistant turn. List-of-parts content is joined from its text parts.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` (a training-time marker)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Not jinja's own tojson: that one HTML-escapes "<", ">", "&" and "'", which would
    # change the prompt text the model was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing loudly on unsafe attribute access.

    jinja's sandbox answers `x.__class__` with an undefined value that prints as "";
    a template that reaches for such attributes is broken or hostile, so say so.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(env: jinja2.Environment, source: str, what: str) -> jinja2.Template:
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what} does not compile: {e.message} (line {e.lineno})") from e


@dataclass(frozen=True)
class ChatTemplateSpec:
    """The chat-template part of a GGUF file's metadata."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    tool_use_source: str | None = None
    is_fallback: bool = False

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplateSpec":
        tokens = meta.get(KEY_TOKENS) or ()

        def token_text(key: str) -> str:
            i = meta.get(key)
            return str(tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else ""

        source = meta.get(KEY_CHAT_TEMPLATE)
        tool_use = meta.get(KEY_CHAT_TEMPLATE_NAMED + "tool_use")
        return cls(
            source=str(source) if source else CHATML_TEMPLATE,
            bos_token=token_text(KEY_BOS),
            eos_token=token_text(KEY_EOS),
            tool_use_source=str(tool_use) if tool_use else None,
            is_fallback=not source,
        )


class ChatTemplate:
    """A compiled chat template (see the module docstring)."""

    def __init__(self, spec: ChatTemplateSpec):
        self.spec = spec
        env = _environment()
        self._template = _compile(env, spec.source, "chat template")
        self._tool_use = (
            _compile(env, spec.tool_use_source, "tool_use chat template") if spec.tool_use_source else None
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplate":
        return cls(ChatTemplateSpec.from_metadata(meta))

    @classmethod
    def from_source(cls, source: str, *, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        return cls(ChatTemplateSpec(source=source, bos_token=bos_token, eos_token=eos_token))

    @property
    def source(self) -> str:
        return self.spec.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (and `tools`, if the template uses them)."""
        template = self._tool_use if (tools and self._tool_use is not None) else self._template
        variables: dict[str, Any] = {
            "bos_token": self.spec.bos_token,
            "eos_token": self.spec.eos_token,
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            # SecurityError (sandbox), UndefinedError, TemplateRuntimeError ...
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
