"""The one preparation path from an API's request to the `GenerationRequest` the worker runs.

Each translation (`server.api_openai`, `api_anthropic`, `api_responses`) reads its own request
into the neutral records below and hands them here; what stays in a translation is only what
its API has of its own: which fields it reads and how it names them, its extra checks, how it
maps messages and tools (`server.tools.apis`), and what it needs to answer.

- `Sampling`: the sampling fields as the request spelled them (None: left out; `of(req)`
  reads them from a schema); `check()` applies the ignore_eos rule, `spec()` gives the
  engine's `SamplingSpec`.
- `TokenLimit(requested, default, param)`: the request's own limit, the one the server and
  API give a request that sets none (None: the room left in the context), and the field an
  error names; `resolve(...)` is `apibase.resolve_max_tokens`.
- `GenerationSettings`: everything a request asks of the generation besides its prompt
  (sampling, limit, stop sequences and their field, log-probs).
- `OutputRules.checked(json_format, choice, tools, ignore_eos=...)`: what a chat request allows
  its output to be, checked together (`server.structured.check`).
- `PromptTokens(text, ids, param, user_boundary)`: a tokenized prompt and the field a
  context-length error names.
- `template_kwargs(value, param)`: a request's extra chat-template variables
  (`ChatRequest.template_kwargs`, passed to the render), refused where they would replace
  what the renderer sets itself.

The path, in this order (each step's error is `server.apibase`'s, naming the request's field):

    prepare_chat(model, calling, ChatRequest) -> GenerationRequest      the three chat APIs
        render (chat template, tool syntax, replay memory; the tools the choice shows)
        -> tokenize_prompt: the size check that needs no tokenizing, then tokenize
        -> generation_request(n_ctx, tokens, settings, ...)
    generation_request(...)                                              also raw completions
        context-length check -> token limit (never past the room left) -> sampling
        (ignore_eos needs temperature 0) -> stop sequences -> `GenerationRequest`

So the same prompt and limits give the same error text, status and code in every API. The
Completions API tokenizes its raw prompts itself (no chat template, token-id lists, its own
size check per prompt) and joins the path at `generation_request`; it applies
`Sampling.check()` before it reads a prompt, as it always has.

It runs on the request-preparation threads (`server.prepare`), does no I/O of its own and
answers nothing: the translations build their responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from server.apibase import check_context, check_prompt_size, resolve_max_tokens, sampling_spec, stop_list
from server.errors import ApiError
from server.jobs import GenerationRequest, SamplingSpec
from server.prompting import ToolCalling, prompt_ids
from server.structured import JsonFormat, ToolChoice, check, constraint_factory, tools_to_render
from server.tools import Message, ToolSpec


@dataclass(frozen=True)
class Sampling:
    """A request's sampling fields as it spelled them (None: left out)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    """Checked (token id, bias) pairs (`apibase.logit_bias_pairs`); only the OpenAI APIs have the field."""

    @classmethod
    def of(cls, req: Any, logit_bias: tuple[tuple[int, float], ...] = ()) -> Sampling:
        """The sampling fields of a request schema; every API here names them alike (`ignore_eos`
        is an extension of each)."""
        return cls(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                   ignore_eos=bool(req.ignore_eos), logit_bias=logit_bias)

    def spec(self) -> SamplingSpec:
        """The engine's settings; a 400 naming `ignore_eos` unless temperature is set to 0."""
        return sampling_spec(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             min_p=self.min_p, seed=self.seed, ignore_eos=self.ignore_eos,
                             logit_bias=self.logit_bias)

    def check(self) -> None:
        """The one rule of `spec()`, for an API that applies it before it reads its prompt."""
        self.spec()


@dataclass(frozen=True)
class TokenLimit:
    requested: int | None
    """The request's own limit (None: it sets none)."""
    default: int | None
    """The limit of a request that sets none (`RequestDefaults.max_tokens_for`); None: the room
    left in the context."""
    param: str
    """The field an error about the limit names (`max_tokens`, `max_output_tokens` ...)."""

    def resolve(self, n_prompt: int, n_ctx: int, ignore_eos: bool) -> int:
        return resolve_max_tokens(self.requested, self.default, n_prompt, n_ctx, ignore_eos, self.param)


@dataclass(frozen=True)
class GenerationSettings:
    """What a request asks of its generation besides the prompt, as its API read it."""
    sampling: Sampling
    limit: TokenLimit
    stop: str | list[str] | None = None
    stop_param: str = "stop"
    top_logprobs: int | None = None
    """None: no log-probs; k >= 0: each sampled token's log-prob and the k most likely."""
    prompt_logprobs: int | None = None
    """None: the prompt is only prefilled; k >= 0: each prompt token is scored first."""


@dataclass(frozen=True)
class OutputRules:
    """What a chat request allows its output to be: the tools it offers, its tool choice and
    its JSON format (None: free text)."""
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice()
    json_format: JsonFormat | None = None

    @classmethod
    def checked(cls, *, json_format: JsonFormat | None, choice: ToolChoice, tools: Sequence[ToolSpec],
                ignore_eos: bool) -> OutputRules:
        """The rules once they are known to go together (a 400 naming the field if not). The
        keyword order is the order a translation reads them in, which decides the error of a
        request with several bad fields."""
        check(choice, json_format, tools, ignore_eos=ignore_eos)
        return cls(tuple(tools), choice, json_format)

    @property
    def shown_tools(self) -> list[ToolSpec]:
        """The tools the prompt shows (none for the choice "none")."""
        return tools_to_render(self.choice, self.tools)


@dataclass(frozen=True)
class PromptTokens:
    text: str
    """The prompt text that prefix reuse and the disk cache match on (`engine.prompt_text`)."""
    ids: tuple[int, ...]
    param: str
    """The request field a context-length error names."""
    user_boundary: int | None = None
    """Where the last user turn starts in `text` (`server.prompting.ChatPrompt`)."""


@dataclass(frozen=True)
class ChatRequest:
    """One chat API's request in neutral form."""
    api: str
    """"openai", "anthropic" or "responses": the prefix of the call ids the output splitter makes."""
    messages: list[Message]
    rules: OutputRules
    settings: GenerationSettings
    prompt_param: str
    """The field that holds the conversation (`messages`, `input`), named by prompt errors."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (`chat_template_kwargs`, e.g. `enable_thinking`),
    checked by `template_kwargs`."""


# Variables the renderer sets itself: a request may not replace them.
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "raise_exception", "strftime_now", "documents", "tool_choice"})


def template_kwargs(value: dict[str, Any] | None, param: str) -> dict[str, Any]:
    """A request's extra chat-template variables; a 400 naming `param` for one the renderer sets itself."""
    out = dict(value or {})
    for key in out:
        if not key.isidentifier() or key in TEMPLATE_OWN_VARIABLES:
            raise ApiError(400, f"{param}: {key!r} cannot be set (the server sets the template's "
                                f"{', '.join(sorted(TEMPLATE_OWN_VARIABLES))} itself; other names must be "
                                "identifiers)", param=param)
    return out


def tokenize_prompt(model: Any, text: str, param: str, user_boundary: int | None = None) -> PromptTokens:
    """The ids of a rendered prompt, refused first, without tokenizing, when its length alone
    cannot fit the context."""
    check_prompt_size(model, text, param)
    return PromptTokens(text, tuple(prompt_ids(model, text)), param, user_boundary)


def generation_request(n_ctx: int, tokens: PromptTokens, settings: GenerationSettings, *,
                       new_splitter: Callable[[], Any] | None = None,
                       new_constraint: Callable[[Any, Any], Any] | None = None) -> GenerationRequest:
    """The generation of a tokenized prompt: the context-length rule, the token limit, the
    sampling and the stop sequences, checked in that order."""
    n_prompt = len(tokens.ids)
    check_context(n_prompt, n_ctx, tokens.param)
    max_tokens = settings.limit.resolve(n_prompt, n_ctx, settings.sampling.ignore_eos)
    sampling = settings.sampling.spec()
    return GenerationRequest(
        prompt_text=tokens.text, prompt_ids=tokens.ids, max_tokens=max_tokens, user_boundary=tokens.user_boundary,
        sampling=sampling, stop=stop_list(settings.stop, settings.stop_param), top_logprobs=settings.top_logprobs,
        prompt_logprobs=settings.prompt_logprobs, new_splitter=new_splitter, new_constraint=new_constraint)


def prepare_chat(model: Any, calling: ToolCalling, request: ChatRequest) -> GenerationRequest:
    """Render, tokenize and check one chat request; the generation splits its output with the
    model's tool syntax and is held to the request's output rules."""
    rules = request.rules
    prompt = calling.render(model, request.messages, rules.shown_tools, **request.template_kwargs)
    tokens = tokenize_prompt(model, prompt.text, request.prompt_param, prompt.user_boundary)
    return generation_request(
        model.n_ctx, tokens, request.settings,
        new_splitter=lambda: calling.new_splitter(prompt, request.api),
        new_constraint=constraint_factory(rules.choice, rules.json_format, calling.syntax, prompt.tools))
