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
  `indent` (at most 64 characters), `separators` and `sort_keys`; with
  `ensure_ascii=True` and a `PromptText` given, the JSON goes through its `ascii_json`,
  so that message strings escaped as prompt text (`engine.prompt_text`) stay text;
* the `{% generation %}...{% endgeneration %}` block that training templates use to
  mark assistant text; here it only renders its body.

Messages go to the template untouched: `content` may be a string or a list of parts
such as `{"type": "text", "text": ...}`; the template decides what to do with them.

If the file has no template, the turn format its vocabulary was made for is used where
`FALLBACK_TEMPLATES` knows it (Gemma's `<start_of_turn>` turns: `GEMMA_TEMPLATE`), else
`CHATML_TEMPLATE` (see there). If the file has
a named `tool_use` template (`tokenizer.chat_template.tool_use`) it is used when
tools are passed, as transformers does.

Any failure while compiling or rendering (a syntax error, `raise_exception`, a
sandbox violation, a type error inside the template) raises `ChatTemplateError`
whose message says what went wrong; `raise_exception` raises its subclass
`ChatTemplateRejected` (the template refuses this conversation: the caller's input).

Limits (`RenderLimits`, given to `ChatTemplate(spec, limits)`, the same for every
call): a template comes with the model file and may be hostile or broken, so a render is
bounded in time and size. `range()` yields at most `max_range` items; `*` and `+` on strings
and lists, `~` concatenation, `%` formatting, and `**` on numbers, refuse results beyond
`max_output_chars` (or 4096 bits); filter and method calls refuse integer arguments beyond
it and, where the result's size follows from the arguments (`replace`, `join`, `format` and
`str.format` widths and precisions, `indent`, `wordwrap`), results beyond it before they are
built, and any other result beyond it once built; the output stops at `max_output_chars`;
and a render that runs past `max_seconds` is aborted: sandbox calls check the clock, and a
watchdog thread raises the abort inside the rendering thread (an asynchronous exception,
delivered between bytecodes) for loops that make no call at all. Nothing is evaluated at
compile time (no constant folding; filters take the context, which jinja never folds), so
compiling costs no more than parsing. Each raises `ChatTemplateLimitError` naming the limit, and the thread
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
import re
import string
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.prompt_text import PromptText

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

# Gemma's turn format (gemma, gemma2, gemma3 instruction-tuned checkpoints), rendering what the
# checkpoints' own template renders: BOS first; no system role, so a leading system message's
# text and a blank line open the first user turn; "assistant" is called "model"; each message
# is "<start_of_turn>{role}\n{content, trimmed}<end_of_turn>\n"; roles must alternate
# user/model after the system message (the checkpoints' template refuses otherwise); the
# generation prompt opens a model turn.  Used for Gemma files that carry no template (the
# Gemma 3 270M GGUF of the `gemma` test extra is one).
GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set head = messages[0]['content'] -%}"
    "{%- set preamble = (head if head is string else head[0]['text']) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set preamble = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}"
    "{{- preamble if loop.first else '' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

# Templates for files without one, by a control token that only that turn format uses: the
# first whose token the vocabulary holds is used, ChatML where none is.
FALLBACK_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("<start_of_turn>", GEMMA_TEMPLATE),
)


def fallback_template(tokens: Sequence[str]) -> str:
    """The template for a file that carries none, chosen by its vocabulary `tokens`."""
    vocabulary = set(tokens)
    return next((source for marker, source in FALLBACK_TEMPLATES if marker in vocabulary), CHATML_TEMPLATE)


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
# Longest `tojson` indent: each nesting level writes it again, so a long indent times a deep
# value is a huge string made in one piece. Templates indent JSON by a few spaces.
MAX_JSON_INDENT = 64


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


# Result sizes known before a call is made: "filter:NAME" or "call:NAME" (a method or
# function called from the template) -> (positional arguments, the bound string first for
# a string method; keyword arguments) -> an upper bound of the result's length, or None.
SizeEstimate = Callable[[tuple[Any, ...], Mapping[str, Any]], "int | None"]
_RESULT_SIZES: dict[str, SizeEstimate] = {}


def _result_size(*keys: str) -> Callable[[SizeEstimate], SizeEstimate]:
    def register(fn: SizeEstimate) -> SizeEstimate:
        for key in keys:
            _RESULT_SIZES[key] = fn
        return fn
    return register


def _ints(values: Any) -> int:
    return sum(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


@_result_size("filter:replace", "call:replace")
def _replace_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    if len(args) >= 3 and all(isinstance(a, str) for a in args[:3]) and args[1]:
        return len(args[0]) + args[0].count(args[1]) * max(len(args[2]) - len(args[1]), 0)
    return None


# A printf conversion: %(key)flags width.precision length type; widths and precisions pad.
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?.")


def printf_size(fmt: str, values: Any) -> int:
    """An upper bound of the length of `fmt % values` beyond the lengths of the values' texts."""
    size, star = len(fmt), False
    for m in _PRINTF.finditer(fmt):
        for n in m.groups():
            star |= n == "*"
            size += int(n) if n and n != "*" else 0
    args = values if isinstance(values, tuple) else (values,)
    return size + (_ints(args) if star else 0)


@_result_size("filter:format")
def _printf_filter_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    return printf_size(args[0], args[1:]) if args and isinstance(args[0], str) else None


@_result_size("call:format", "call:format_map")
def _braces_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """`str.format`: the widths and precisions of the replacement fields (nested `{}` in a field's
    spec take integer arguments)."""
    if not args or not isinstance(args[0], str):
        return None
    try:
        specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(args[0])]
    except ValueError:
        return None  # the call itself reports the malformed format
    size = len(args[0]) + sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))
    nested = any("{" in spec for spec in specs)
    mapping = args[1] if len(args) > 1 and isinstance(args[1], Mapping) else {}
    return size + (_ints(args[1:]) + _ints(kwargs.values()) + _ints(mapping.values()) if nested else 0)


def _joined_size(items: Any, sep: Any) -> int | None:
    if not isinstance(items, (list, tuple)) or not isinstance(sep, str):
        return None  # a generator is not consumed twice; its result is checked once built
    return sum(len(x) if isinstance(x, str) else 0 for x in items) + len(sep) * max(len(items) - 1, 0)


@_result_size("filter:join")
def _join_filter_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    return _joined_size(args[0], args[1] if len(args) > 1 else kwargs.get("d", "")) if args else None


@_result_size("call:join")
def _join_method_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    return _joined_size(args[1], args[0]) if len(args) == 2 else None


@_result_size("filter:indent")
def _indent_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    width = args[1] if len(args) > 1 else kwargs.get("width", 4)
    if not args or not isinstance(args[0], str):
        return None
    step = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(args[0]) + (args[0].count("\n") + 1) * max(step, 0)


@_result_size("filter:wordwrap")
def _wordwrap_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    if not args or not isinstance(args[0], str):
        return None
    width = args[1] if len(args) > 1 else kwargs.get("width", 79)
    wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring")
    breaks = len(args[0]) // max(width if isinstance(width, int) else 1, 1) + 1
    return len(args[0]) + breaks * (len(wrap) if isinstance(wrap, str) else 1)


def _guard_call(state: _RenderState, kind: str, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a filter or method call whose result would be huge before it is made: an integer
    argument beyond the output bound (`center(2**31)`, `ljust`, `indent`, `wordwrap` ...), or a
    result that `_RESULT_SIZES` can tell is beyond it. `kind` is "filter" or "call"."""
    state.check()
    cap = state.limits.max_output_chars
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and a > cap:
            raise ChatTemplateLimitError(f"chat template call {name}() with an argument of {a} (more than {cap})")
    estimate = _RESULT_SIZES.get(f"{kind}:{name}")
    size = estimate(args, kwargs) if estimate is not None else None
    if size is not None:
        state.check_size(size, f"{name}() result")


def _limited_filter(name: str, fn: Any) -> Any:
    # What the filter takes before its value: the context, the evaluation context, the
    # environment, or nothing.
    passes = getattr(getattr(fn, "jinja_pass_arg", None), "name", None)

    def limited(context: Any, *args: Any, **kwargs: Any) -> Any:
        first = {"context": (context,), "eval_context": (context.eval_ctx,),
                 "environment": (context.environment,)}.get(passes, ())
        state = _current()
        if state is None:
            return fn(*first, *args, **kwargs)
        _guard_call(state, "filter", name, args, kwargs)
        out = fn(*first, *args, **kwargs)
        size = _sized(out)
        if size is not None:
            state.check_size(size, f"{name} filter result")
        return out
    # Taking the context also keeps jinja from calling the filter on constants at compile
    # time, outside the render limits (`'%999999999d'|format(1)` is a gigabyte).
    return jinja2.pass_context(functools.update_wrapper(limited, fn))


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


def _json_filter(prompt_text: PromptText | None) -> Callable[..., str]:
    def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Not jinja's own tojson: that one HTML-escapes "<", ">", "&" and "'", which would
        # change the prompt text the model was trained on.
        step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        if step > MAX_JSON_INDENT:
            raise ChatTemplateLimitError(f"chat template tojson indent of {step} is longer than {MAX_JSON_INDENT}")
        ascii_here = ensure_ascii and prompt_text is None
        text = json.dumps(value, ensure_ascii=ascii_here, indent=indent, separators=separators, sort_keys=sort_keys)
        return prompt_text.ascii_json(text) if ensure_ascii and prompt_text is not None else text
    return tojson


class _ConcatCodeGenerator(CodeGenerator):
    """Compiles `~` to the environment's `concat_parts`, which checks the result's size (jinja's own
    code joins the parts directly, out of the sandbox's reach)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        markup = ("context.eval_ctx.volatile" if frame.eval_ctx.volatile
                  else "True" if frame.eval_ctx.autoescape else "False")
        self.write("environment.concat_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {markup})")


_BINOPS = {"*": operator.mul, "+": operator.add, "**": operator.pow, "%": operator.mod}


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing loudly on unsafe attribute access.

    jinja's sandbox answers `x.__class__` with an undefined value that prints as "";
    a template that reaches for such attributes is broken or hostile, so say so.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    code_generator_class = _ConcatCodeGenerator

    # Sizes and time: every intercepted operator, attribute, item and call checks them.
    intercepted_binops = frozenset({"*", "+", "**", "%"})

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
            elif op == "%" and isinstance(left, str):
                state.check_size(printf_size(left, right), "% formatting")
        out = _BINOPS[op](left, right)
        if state is not None and op == "%" and isinstance(out, str):
            state.check_size(len(out), "% formatting")
        return out

    def concat_parts(self, parts: tuple[Any, ...], markup: bool) -> str:
        """`a ~ b ~ ...`: the parts' texts joined, refused beyond the output bound."""
        texts = [str(p) for p in parts]
        state = _current()
        if state is not None:
            state.check()
            state.check_size(sum(map(len, texts)), "concatenation")
        return markup_join(parts) if markup else "".join(texts)

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

    def wrap_str_format(self, value: Any) -> Any:
        # jinja hands out `str.format` (and `format_map`) already wrapped at attribute access; the
        # wrapper no longer shows its format string, so check the sizes here.
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, name = value.__self__, value.__name__

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            state = _current()
            if state is not None:
                _guard_call(state, "call", name, (fmt, *args), kwargs)
            return wrapped(*args, **kwargs)
        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        state = _current()
        if state is None:
            return super().call(__context, __obj, *args, **kwargs)
        bound = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "call")
        _guard_call(state, "call", name, ((bound,) if isinstance(bound, str) else ()) + args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        size = _sized(out)
        if size is not None:
            state.check_size(size, f"{name}() result")
        return out


def _environment(prompt_text: PromptText | None = None) -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        # No constant folding: nothing is evaluated at compile time, outside the render limits.
        optimized=False,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _json_filter(prompt_text)
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
            source=str(source) if source else fallback_template(tokens),
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

    def __init__(self, spec: ChatTemplateSpec, limits: RenderLimits = DEFAULT_LIMITS,
                 prompt_text: PromptText | None = None):
        self.spec = spec
        self.limits = limits
        env = _environment(prompt_text)
        self._template = _compile(env, spec.source, "chat template")
        self._tool_use = (
            _compile(env, spec.tool_use_source, "tool_use chat template") if spec.tool_use_source else None
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], prompt_text: PromptText | None = None) -> "ChatTemplate":
        """The file's template; `prompt_text` (the tokenizer's rules) makes `tojson(ensure_ascii=True)`
        keep the escapes of prompt text."""
        return cls(ChatTemplateSpec.from_metadata(meta), prompt_text=prompt_text)

    @classmethod
    def from_source(cls, source: str, *, bos_token: str = "", eos_token: str = "",
                    prompt_text: PromptText | None = None) -> "ChatTemplate":
        return cls(ChatTemplateSpec(source=source, bos_token=bos_token, eos_token=eos_token), prompt_text=prompt_text)

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
