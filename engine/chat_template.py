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
whose message says what went wrong; `raise_exception` raises its subclass
`ChatTemplateRejected` (the template refuses this conversation: the caller's input).

Limits (`RenderLimits`, per template; `render(..., limits=...)` overrides them for one
call): a template comes with the model file and may be hostile or broken, so a render is
bounded in time and size. `range()` yields at most `max_range` items; `*` and `+` on strings
and lists, and `**` on numbers, refuse results beyond `max_output_chars` (or 4096 bits);
the output stops at `max_output_chars`; and a render that runs past `max_seconds` is
aborted: sandbox calls check the clock, and a watchdog thread raises the abort inside the
rendering thread (an asynchronous exception, delivered between bytecodes) for loops that
make no call at all. Each raises `ChatTemplateLimitError` naming the limit, and the thread
is free again. `probe()` renders a small conversation, for a check at load time.

It does not tokenize, validate message schemas, parse model output, or render tool
calls in a model-specific syntax beyond what the template itself does.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import json
import operator
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator, Mapping, Sequence

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


class ChatTemplateRejected(ChatTemplateError):
    """The template called `raise_exception`: it refuses this conversation."""


class ChatTemplateLimitError(ChatTemplateError):
    """A render went past one of its `RenderLimits`."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds of one render (see the module docstring)."""
    max_seconds: float = 10.0
    max_output_chars: int = 64 * 2**20
    max_range: int = 100_000


DEFAULT_LIMITS = RenderLimits()
_MAX_POWER_BITS = 4096


class _Aborted(BaseException):
    """Raised asynchronously in a render that ran out of time (a BaseException, so that no
    `except Exception` inside jinja swallows it)."""


class _RenderState:
    """The limits of the render running on this thread, and its deadline."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"chat template render took longer than {self.limits.max_seconds:g} s")

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.max_output_chars:
            raise ChatTemplateLimitError(f"chat template {what} of {size} items is longer than "
                                         f"{self.limits.max_output_chars}")


_state = threading.local()


def _current() -> _RenderState | None:
    return getattr(_state, "render", None)


class _Watchdog:
    """One daemon thread that aborts renders past their deadline (PyThreadState_SetAsyncExc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, int]] = []  # (deadline, ticket, thread id)
        self._live: dict[int, bool] = {}  # ticket -> fired
        self._tickets = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> int:
        with self._lock:
            self._tickets += 1
            ticket = self._tickets
            self._live[ticket] = False
            heapq.heappush(self._heap, (deadline, ticket, threading.get_ident()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
            return ticket

    def disarm(self, ticket: int) -> None:
        with self._lock:
            fired = self._live.pop(ticket, False)
            if fired:
                # The abort may still be pending (not yet delivered): clear it, or it would
                # hit whatever this thread runs next.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)

    def _run(self) -> None:
        with self._lock:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                deadline, ticket, tid = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self._live[ticket] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Aborted))


_WATCHDOG = _Watchdog()


class _CheckedRange:
    """range() for templates: a sequence (len, indexing, `in`) whose iteration checks the clock."""

    def __init__(self, r: range) -> None:
        self._r = r

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        v = self._r[i]
        return _CheckedRange(v) if isinstance(v, range) else v

    def __contains__(self, x: Any) -> bool:
        return x in self._r

    def __iter__(self) -> Iterator[int]:
        state = _current()
        for i in self._r:
            if state is not None and not i & 255:
                state.check()
            yield i

    def __reversed__(self) -> Iterator[int]:
        return iter(_CheckedRange(self._r[::-1]))


def _limited_range(*args: int) -> _CheckedRange:
    r = range(*args)
    state = _current()
    limit = state.limits.max_range if state is not None else DEFAULT_LIMITS.max_range
    if len(r) > limit:
        raise ChatTemplateLimitError(f"chat template range() of {len(r)} items is longer than {limit}")
    return _CheckedRange(r)


def _sized(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


def _guard_call(state: _RenderState, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a filter or method call whose result would be huge before it is made: an integer
    argument beyond the output bound (`center(2**31)`, `ljust`, `indent`, `wordwrap` ...), or a
    `replace` that would grow the text past it."""
    state.check()
    cap = state.limits.max_output_chars
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > cap:
            raise ChatTemplateLimitError(f"chat template call {name}() with an argument of {a} (more than {cap})")
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]) and args[1]:
        grown = len(args[0]) + args[0].count(args[1]) * (len(args[2]) - len(args[1]))
        state.check_size(grown, "replace() result")


def _limited_filter(name: str, fn: Any) -> Any:
    def limited(*args: Any, **kwargs: Any) -> Any:
        state = _current()
        if state is None:
            return fn(*args, **kwargs)
        # A filter may take the context or environment first; the value follows it.
        skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
        _guard_call(state, name, args[skip:], kwargs)
        out = fn(*args, **kwargs)
        size = _sized(out)
        if size is not None:
            state.check_size(size, f"{name} filter result")
        return out
    functools.update_wrapper(limited, fn)
    return limited


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` (a training-time marker)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateRejected(f"chat template raised: {message}")


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

    # Sizes and time: every intercepted operator, attribute, item and call checks them.
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        state = _current()
        if state is not None:
            state.check()
            if op == "*":
                for seq, n in ((left, right), (right, left)):
                    size = _sized(seq)
                    if size is not None and isinstance(n, int):
                        state.check_size(size * max(n, 0), "repetition")
            elif op == "+":
                a, b = _sized(left), _sized(right)
                if a is not None and b is not None:
                    state.check_size(a + b, "concatenation")
            elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right * max(abs(left).bit_length(), 1) > _MAX_POWER_BITS:
                    raise ChatTemplateLimitError(f"chat template power {left} ** {right} is too large")
        return {"*": operator.mul, "+": operator.add, "**": operator.pow}[op](left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        state = _current()
        if state is not None:
            state.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        state = _current()
        if state is not None:
            state.check()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        state = _current()
        if state is None:
            return super().call(__context, __obj, *args, **kwargs)
        bound = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "call")
        _guard_call(state, name, ((bound,) if isinstance(bound, str) else ()) + args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        size = _sized(out)
        if size is not None:
            state.check_size(size, f"{name}() result")
        return out


def _environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _limited_range
    for name, fn in list(env.filters.items()):
        env.filters[name] = _limited_filter(name, fn)
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


# The conversation `ChatTemplate.probe` renders: the turns every chat template must handle.
PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
)
# The watchdog fires this long after the deadline: the cooperative checks come first, with the
# clearer message.
WATCHDOG_GRACE_S = 0.5


class ChatTemplate:
    """A compiled chat template (see the module docstring)."""

    def __init__(self, spec: ChatTemplateSpec, limits: RenderLimits = DEFAULT_LIMITS):
        self.spec = spec
        self.limits = limits
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
        if _current() is not None:  # a template rendering a template: the outer limits hold
            return self._render(template, variables)
        state = _RenderState(self.limits)
        _state.render = state
        ticket = _WATCHDOG.arm(state.deadline + WATCHDOG_GRACE_S)
        try:
            return self._render(template, variables)
        except _Aborted:
            raise ChatTemplateLimitError(f"chat template render took longer than {self.limits.max_seconds:g} s "
                                         "and was aborted") from None
        finally:
            _WATCHDOG.disarm(ticket)
            _state.render = None

    def _render(self, template: jinja2.Template, variables: dict[str, Any]) -> str:
        state = _current()
        cap = state.limits.max_output_chars if state is not None else DEFAULT_LIMITS.max_output_chars
        try:
            out: list[str] = []
            size = 0
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > cap:
                    raise ChatTemplateLimitError(f"chat template output is longer than {cap} characters")
                out.append(chunk)
            return "".join(out)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            # SecurityError (sandbox), UndefinedError, TemplateRuntimeError ...
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        except MemoryError:
            raise ChatTemplateLimitError("chat template render ran out of memory") from None
        except RecursionError:
            raise ChatTemplateLimitError("chat template render recursed too deeply") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def probe(self) -> None:
        """Render a small conversation (system, user, assistant, user); ChatTemplateError if the
        template cannot, so that a broken or hostile template is reported when it is loaded."""
        self.render(PROBE_MESSAGES, add_generation_prompt=True)
