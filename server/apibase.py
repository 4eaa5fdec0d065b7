"""Pieces shared by the three API modules: schema base class, validation, limits, ids, stream writers.

- `StrictModel`: pydantic base for request schemas. Unknown members are ignored (clients
  send vendor extras such as `user` or `metadata`); known members are type-checked
  strictly, so `"0.5"` is not a temperature and `true` is not a token count.
- `validate_body(schema, obj)`: a validated request or a 400 `ApiError` naming the field.
- `check_context(...)`: the context-length rule applied before a job is queued;
  `check_prompt_size(model, text, param)` applies it before tokenizing, from a lower bound
  on the token count (characters / the vocabulary's longest token in bytes), so that a
  prompt of megabytes is refused in microseconds instead of being tokenized whole.
- `RequestDefaults` (the server's defaults for what a request leaves out, from its flags) and
  `resolve_max_tokens(...)`: the tokens a request may generate.
- `sampling_spec(...)`: the ignore_eos rules and the translation into `SamplingSpec`;
  `logit_bias_pairs(value, n_vocab)` reads OpenAI's `logit_bias` (token-id keys as strings,
  biases in [-100, 100]), a 400 naming the field otherwise.
- `Refused(field, why, neutral)` and `StrictModel.refused`: documented request fields (and
  other servers' common extensions) that this server does not honour. `validate_body` answers
  a 400 naming the field when a body sets one to anything but a neutral value (the value that
  asks for nothing, such as `repeat_penalty: 1`), before the schema is applied: an option the
  server would not honour is refused, never silently dropped. Fields that by their API's own
  definition do not change the output (`user`, `metadata`, `store` ...) are simply accepted.
- The bounds every API shares for its sampling fields (`TOP_P`, `MIN_P`, `TOP_K`, `SEED`,
  `TOKEN_COUNT`, `STOP_*`): one definition, so a value the engine's sampler refuses (such as
  `top_p: 0`) is a 400 naming the field on every endpoint, never a 500 from the sampler.
- `stop_list(value, param)`: the stop sequences of a request, bounded in count and length.
- `new_id(prefix)`: response and item ids from a CSPRNG.
- `StreamWriter` and `@writes(kind, ...)`: the base of every API's SSE stream writer. A writer
  keeps its stream's state in attributes and has one method per event kind it answers (worker
  events such as `TextDelta` or `Finished`, and the splitter's `ContentDelta`, `ReasoningDelta`,
  `ToolCallEnd`), registered by type with `@writes` (a subclass's method for a kind replaces
  its base's); `stream(events)` sends `opening()`, a keepalive comment for each `None` tick
  and each event's frames, then `closing()`, unless a method ended the stream early with
  `end(...)` (a failure: later events are not written). Kinds a writer has no method for are
  skipped. It knows no API's event names or payloads.

The preparation path that uses these rules is `server.genrequest`. No HTTP, no model calls.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import ApiError, from_validation_error
from server.jobs import SamplingSpec
from server.sse import KEEPALIVE

M = TypeVar("M", bound=BaseModel)

# Seeds in this range are accepted and folded into 0..2**63-1 (any RNG can take that);
# anything wider is almost certainly a client bug.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Upper bound for token counts in requests: large enough for any real context, small
# enough that arithmetic on it stays cheap.
MAX_TOKENS_LIMIT = 2**31 - 1
# Tokens generated for a request that sets no limit (`--max-tokens-default`): long enough for
# any ordinary answer, short enough that a client's probe request without a limit cannot
# occupy the server for minutes.
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class RequestDefaults:
    """What the server fills in for what a request leaves out (one field per flag)."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """`--max-tokens-default`: tokens generated when a request sets no limit, never more than
    the room left in the context; 0: the room left, with no cap of its own."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens_default must be 0 or more, got {self.max_tokens}")

    def max_tokens_for(self, api_default: int | None = None) -> int | None:
        """The limit of a request that sets none: the server's default or the API's own, the
        smaller (None: neither, so the room left in the context)."""
        caps = [c for c in (self.max_tokens or None, api_default) if c is not None]
        return min(caps) if caps else None


# Stop sequences are matched against the generated text after every token; their number and
# length bound that work.
STOP_MAX_COUNT = 16
STOP_MAX_CHARS = 4096

# Field bounds shared by the request schemas. top_p is a probability mass the nucleus must
# reach: 0 keeps nothing, so it is excluded (the engine's sampler refuses it).
TOP_P = Field(None, gt=0.0, le=1.0)
MIN_P = Field(None, ge=0.0, le=1.0)
TOP_K = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
SEED = Field(None, ge=SEED_MIN, le=SEED_MAX)
TOKEN_COUNT = Field(None, ge=1, le=MAX_TOKENS_LIMIT)


@dataclass(frozen=True)
class Refused:
    """A request field this server does not honour."""
    field: str
    why: str
    """Completes "`field` is not supported by this server (...)"."""
    neutral: tuple[Any, ...] = (None,)
    """Values that ask for nothing and are accepted (None: the field sent as null)."""

    def check(self, body: dict[str, Any]) -> None:
        if self.field in body and not any(_same_value(body[self.field], v) for v in self.neutral):
            raise ApiError(400, f"{self.field} is not supported by this server ({self.why})", param=self.field)


def _same_value(value: Any, neutral: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same number, true is not 1, "1" is not 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def refused_sampler_fields() -> tuple[Refused, ...]:
    """Other servers' sampling and decoding extensions (llama.cpp, vLLM, text-generation-webui)
    that clients send to any OpenAI-compatible server; the engine has none of them."""
    off = "the engine has no such sampler; omit it"
    return (
        Refused("repeat_penalty", off, (None, 1.0)), Refused("repetition_penalty", off, (None, 1.0)),
        Refused("penalty_last_n", off, (None, 0)), Refused("length_penalty", off, (None, 1.0)),
        Refused("typical_p", off, (None, 1.0)), Refused("tfs_z", off, (None, 1.0)),
        Refused("top_a", off, (None, 0.0)), Refused("mirostat", off, (None, 0)),
        Refused("mirostat_tau", off), Refused("mirostat_eta", off),
        Refused("dry_multiplier", off, (None, 0.0)), Refused("xtc_probability", off, (None, 0.0)),
        Refused("dynatemp_range", off, (None, 0.0)), Refused("samplers", off),
        Refused("min_tokens", "generation cannot be held back from stopping; omit it", (None, 0)),
        Refused("use_beam_search", "there is no beam search", (None, False)),
        Refused("stop_token_ids", "stop on text with `stop`"),
        Refused("bad_words", "ban tokens with `logit_bias` -100"),
        Refused("allowed_token_ids", "restrict tokens with `logit_bias` +100"),
        Refused("grammar", "use a JSON schema response format"),
        Refused("json_schema", "use a JSON schema response format"),
        Refused("guided_json", "use a JSON schema response format"),
        Refused("guided_regex", "regular expressions are not supported"),
        Refused("guided_grammar", "use a JSON schema response format"),
        Refused("guided_choice", "use a JSON schema with an enum"),
        Refused("structured_outputs", "use a JSON schema response format"),
        Refused("n_probs", "use `logprobs`/`top_logprobs`"),
        Refused("prompt_logprobs", "use `echo` with `logprobs` on /v1/completions"),
    )


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    refused: ClassVar[tuple[Refused, ...]] = ()
    """Fields a body of this schema may not set (`Refused`); checked by `validate_body`."""


class OpenModel(BaseModel):
    """For nested objects whose unknown members are passed along (content parts, tools)."""
    model_config = ConfigDict(extra="allow", strict=True)


def validate_body(schema: type[M], obj: Any) -> M:
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(obj).__name__}")
    for refused in getattr(schema, "refused", ()):
        refused.check(obj)
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def context_error(n_prompt: int, n_ctx: int, param: str) -> ApiError:
    return ApiError(
        400,
        f"the prompt has {n_prompt} tokens, which does not fit in the context of "
        f"{n_ctx} tokens (the prompt must be shorter than the context)",
        param=param, code="context_length_exceeded",
        extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def check_context(n_prompt: int, n_ctx: int, param: str) -> None:
    if n_prompt >= n_ctx:
        raise context_error(n_prompt, n_ctx, param)


def min_prompt_tokens(text: str, max_token_bytes: int) -> int:
    """A lower bound on the token count of `text`: no token spells more than `max_token_bytes`
    bytes, and a character is at least one byte."""
    return -(-len(text) // max(1, max_token_bytes))


def check_prompt_size(model: Any, text: str, param: str) -> None:
    """The context-length rule before tokenizing: a 400 when `text` cannot fit however it tokenizes."""
    at_least = min_prompt_tokens(text, model.max_token_bytes)
    if at_least >= model.n_ctx:
        raise ApiError(
            400, f"the prompt has at least {at_least} tokens ({len(text)} characters, no token longer than "
                 f"{model.max_token_bytes} bytes), which does not fit in the context of {model.n_ctx} tokens",
            param=param, code="context_length_exceeded",
            extra={"n_prompt_tokens_at_least": at_least, "n_ctx": model.n_ctx})


def resolve_max_tokens(requested: int | None, default: int | None, n_prompt: int, n_ctx: int,
                       ignore_eos: bool, param: str) -> int:
    """Tokens to generate: the request's limit (or the default), never past the context.
    Only a limit the request gives can be too long for ignore_eos: a default stops at the room left."""
    room = n_ctx - n_prompt
    limit = requested if requested is not None else (default if default is not None else room)
    if ignore_eos and requested is not None and limit > room:
        raise ApiError(400, f"ignore_eos asks for exactly {limit} tokens but only {room} fit "
                            f"after the {n_prompt}-token prompt (context {n_ctx})", param=param)
    return min(limit, room)


def stop_list(stop: str | list[str] | None, param: str) -> tuple[str, ...]:
    """The non-empty stop sequences of a request; a 400 naming `param` past the bounds."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > STOP_MAX_COUNT:
        raise ApiError(400, f"{param}: at most {STOP_MAX_COUNT} stop sequences are supported", param=param)
    for s in stops:
        if len(s) > STOP_MAX_CHARS:
            raise ApiError(400, f"{param}: a stop sequence may have at most {STOP_MAX_CHARS} characters, "
                                f"not {len(s)}", param=param)
    return tuple(s for s in stops if s)


def logit_bias_pairs(value: dict[str, float] | None, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` as (token id, bias) pairs in id order: each key a token id written
    as a decimal string inside the vocabulary, each value a number in [-100, 100]."""
    if not value:
        return ()
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= n_vocab:
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model (0..{n_vocab - 1}, "
                                "written as a string)", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias: the bias of token {key} must be a number in [-100, 100], "
                                f"not {bias!r}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def sampling_spec(*, temperature: float | None, top_p: float | None, top_k: int | None,
                  min_p: float | None, seed: int | None, ignore_eos: bool,
                  default_temperature: float = 1.0,
                  logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingSpec:
    if ignore_eos and temperature != 0:
        raise ApiError(400, "ignore_eos requires temperature to be set explicitly to 0 "
                            "(it decodes greedily for exactly max_tokens tokens)",
                       param="ignore_eos")
    if seed is not None:
        seed %= 2**63  # non-negative and within a signed 64-bit generator seed
    return SamplingSpec(
        temperature=default_temperature if temperature is None else float(temperature),
        top_k=top_k or 0,
        top_p=1.0 if top_p is None else float(top_p),
        min_p=0.0 if min_p is None else float(min_p),
        seed=seed, ignore_eos=ignore_eos, logit_bias=logit_bias)


# --- stream writers -----------------------------------------------------------------------

Frames = list[bytes]
WriterMethod = TypeVar("WriterMethod", bound=Callable[..., Frames])


def writes(*kinds: type) -> Callable[[WriterMethod], WriterMethod]:
    """Marks a `StreamWriter` method as the one that writes the events of `kinds`."""
    def mark(method: WriterMethod) -> WriterMethod:
        method.writes_kinds = kinds  # type: ignore[attr-defined]
        return method
    return mark


class StreamWriter:
    """One response stream: events in, SSE frames out (see the module docstring).

    A subclass's methods take the event (plus whatever its dispatcher passes along, such as a
    choice index) and return the frames it makes, in order; they never yield, so the state
    they change is consistent between events. One writer per stream."""

    _methods: ClassVar[dict[type, str]] = {}
    """Event type -> the name of the method that writes it (by name, so that an override of
    that method in a subclass is the one called)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        methods: dict[type, str] = {}
        # Base classes first, so that a subclass's method for a kind replaces its base's.
        for klass in reversed(cls.__mro__):
            for name, attr in vars(klass).items():
                for kind in getattr(attr, "writes_kinds", ()):
                    methods[kind] = name
        cls._methods = methods

    def __init__(self) -> None:
        self.ended = False

    def opening(self) -> Frames:
        """Frames sent before the first event."""
        return []

    def closing(self) -> Frames:
        """Frames sent after the last event of a stream that was not ended early."""
        return []

    def write(self, event: Any, *args: Any) -> Frames:
        """The frames of one event, from the method registered for its type (none if none is)."""
        name = self._methods.get(type(event))
        return [] if name is None else getattr(self, name)(event, *args)

    def write_all(self, events: Any, *args: Any) -> Frames:
        return [frame for event in events for frame in self.write(event, *args)]

    def end(self, *frames: bytes) -> Frames:
        """The last frames of a stream that ends here (a failure); later events are not written."""
        self.ended = True
        return list(frames)

    async def stream(self, events: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        for frame in self.opening():
            yield frame
        async for event in events:
            if event is None:
                yield KEEPALIVE
                continue
            for frame in self.write(event):
                yield frame
            if self.ended:
                return
        for frame in self.closing():
            yield frame
