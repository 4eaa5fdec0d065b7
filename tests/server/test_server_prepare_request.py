"""Request preparation: the four inference APIs side by side, and the shared path they call
(`server.genrequest`).

Side by side, the same prompt and limits give the same context-length errors, the same token
limits and the same ignore_eos refusals whichever API asks, each naming its own request field.
The translations are called directly (validated body -> `GenerationRequest`s) with the fake
engine, whose prompt of one user message "hi" is 21 tokens in every chat API."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from server import api_anthropic, api_openai, api_responses
from server.apibase import RequestDefaults, validate_body
from server.errors import ApiError
from server.genrequest import (ChatRequest, GenerationSettings, OutputRules, PromptTokens, Sampling, TokenLimit,
                               generation_request, prepare_chat, tokenize_prompt)
from server.jobs import GenerationRequest, SamplingSpec
from server.prompting import ToolCalling
from server.structured import ToolChoice
from server.tools import Message, ToolSpec
from server_fake_engine import FakeModel

CHAT_PROMPT_TOKENS = 21  # "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

Build = Callable[..., list[GenerationRequest]]


def builder(request_type: type, job: Callable[..., Any], body_of: Callable[[str], dict[str, Any]], limit_field: str,
            calling: ToolCalling | None = ToolCalling("hermes")) -> Build:
    """One API's translation called on a validated body: prompt text and token limit in, its requests out."""
    def build(model: Any, text: str, limit: int | None, defaults: RequestDefaults = RequestDefaults(),
              **extra: Any) -> list[GenerationRequest]:
        body = {**body_of(text), **extra}
        if limit is not None:
            body[limit_field] = limit
        gens, _ = job(model, validate_body(request_type, body), calling, defaults)
        return gens if isinstance(gens, list) else [gens]
    return build


def user_says(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


chat = builder(api_openai.ChatCompletionRequest, api_openai.chat_job, user_says, "max_completion_tokens")
messages = builder(api_anthropic.MessagesRequest, api_anthropic.messages_job, user_says, "max_tokens")
responses = builder(api_responses.ResponsesRequest, api_responses.responses_job, lambda t: {"input": t},
                    "max_output_tokens")
completion = builder(api_openai.CompletionRequest, api_openai.completion_job, lambda t: {"prompt": t}, "max_tokens",
                     calling=None)

CHAT_APIS = [(chat, "messages", "max_completion_tokens"), (messages, "messages", "max_tokens"),
             (responses, "input", "max_output_tokens")]
ALL_APIS = [*CHAT_APIS, (completion, "prompt", "max_tokens")]


def refusal(build: Build, *args: Any, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        build(*args, **kw)
    return caught.value


def test_a_prompt_one_token_too_long_is_the_same_error_in_every_chat_api():
    model = FakeModel(n_ctx=CHAT_PROMPT_TOKENS)
    errors = [refusal(build, model, "hi", 1) for build, _, _ in CHAT_APIS]
    assert [e.param for e in errors] == [field for _, field, _ in CHAT_APIS]
    for err in errors:
        assert (err.status, err.type, err.code, err.extra) == (
            400, "invalid_request_error", "context_length_exceeded", {"n_prompt_tokens": 21, "n_ctx": 21})
        assert err.message == ("the prompt has 21 tokens, which does not fit in the context of 21 tokens "
                               "(the prompt must be shorter than the context)")


@pytest.mark.parametrize("build,field,_limit", ALL_APIS)
def test_a_prompt_that_cannot_fit_however_it_tokenizes_is_refused_before_tokenizing(build, field, _limit):
    model = FakeModel(n_ctx=32)
    err = refusal(build, model, "x" * 10_000, 1)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", field)
    assert err.message.startswith("the prompt has at least ")
    assert err.message.endswith(f"no token longer than {model.max_token_bytes} bytes), which does not fit in the "
                                "context of 32 tokens")


@pytest.mark.parametrize("build,field,_limit", ALL_APIS)
def test_the_context_error_names_the_prompt_field(build, field, _limit):
    model = FakeModel(n_ctx=64)
    err = refusal(build, model, "x" * 70, 1)
    n = err.extra["n_prompt_tokens"]
    assert (err.param, err.code) == (field, "context_length_exceeded")
    assert err.extra == {"n_prompt_tokens": n, "n_ctx": 64}
    assert err.message == (f"the prompt has {n} tokens, which does not fit in the context of 64 tokens "
                           "(the prompt must be shorter than the context)")


@pytest.mark.parametrize("build,_field,limit", ALL_APIS)
def test_ignore_eos_past_the_room_left_is_the_same_error_naming_the_limit_field(build, _field, limit):
    model = FakeModel(n_ctx=CHAT_PROMPT_TOKENS + 10)
    err = refusal(build, model, "hi", model.n_ctx, ignore_eos=True, temperature=0)
    n = len(build(model, "hi", 1)[0].prompt_ids)
    assert (err.status, err.param) == (400, limit)
    assert err.message == (f"ignore_eos asks for exactly {model.n_ctx} tokens but only {model.n_ctx - n} fit "
                           f"after the {n}-token prompt (context {model.n_ctx})")


@pytest.mark.parametrize("build,_field,_limit", ALL_APIS)
def test_a_limit_is_kept_and_capped_at_the_room_left(build, _field, _limit):
    model = FakeModel(n_ctx=CHAT_PROMPT_TOKENS + 10)
    n = len(build(model, "hi", 1)[0].prompt_ids)
    assert build(model, "hi", 5)[0].max_tokens == 5
    assert build(model, "hi", 500)[0].max_tokens == model.n_ctx - n


@pytest.mark.parametrize("build,expected", [(chat, 8), (responses, 8), (completion, 8)])
def test_without_a_limit_the_server_default_applies(build, expected):
    assert build(FakeModel(), "hi", None, RequestDefaults(max_tokens=8))[0].max_tokens == expected
    # The Completions API's own default of 16 is the smaller one here; the others have none.
    wide = build(FakeModel(), "hi", None, RequestDefaults(max_tokens=100))[0].max_tokens
    assert wide == (16 if build is completion else 100)


def test_messages_ignore_the_server_default_as_its_limit_is_required():
    assert messages(FakeModel(), "hi", 300, RequestDefaults(max_tokens=8))[0].max_tokens == 300


@pytest.mark.parametrize("build,_field,_limit", CHAT_APIS)
def test_chat_apis_report_the_prompt_before_ignore_eos_without_temperature_0(build, _field, _limit):
    err = refusal(build, FakeModel(n_ctx=16), "hi", 1, ignore_eos=True)
    assert err.code == "context_length_exceeded"
    err = refusal(build, FakeModel(), "hi", 1, ignore_eos=True)
    assert err.param == "ignore_eos" and "temperature" in err.message


def test_completions_report_ignore_eos_without_temperature_0_before_the_prompt():
    err = refusal(completion, FakeModel(n_ctx=16), "x" * 40, 1, ignore_eos=True)
    assert err.param == "ignore_eos" and "temperature" in err.message


# --- the shared path itself (server.genrequest) ----------------------------------------------

def settings(**kw: Any) -> GenerationSettings:
    sampling = kw.pop("sampling", Sampling(temperature=0.0, ignore_eos=True))
    return GenerationSettings(sampling, kw.pop("limit", TokenLimit(4, None, "max_tokens")), **kw)


def tokens(n: int) -> PromptTokens:
    return PromptTokens("x" * n, tuple(range(n)), "messages")


def test_generation_request_checks_context_then_limit_then_sampling_then_stops():
    # Every field below is wrong until the step before it is put right: the first wrong one is reported.
    bad_sampling = Sampling(ignore_eos=True)  # ignore_eos without temperature 0
    bad_limit = TokenLimit(100, None, "max_output_tokens")  # more than the room left, with ignore_eos
    too_many_stops = [str(i) for i in range(17)]
    steps = [(tokens(32), bad_limit, bad_sampling, "messages", "context_length_exceeded"),
             (tokens(8), bad_limit, bad_sampling, "max_output_tokens", None),
             (tokens(8), TokenLimit(4, None, "max_output_tokens"), bad_sampling, "ignore_eos", None),
             (tokens(8), TokenLimit(4, None, "max_output_tokens"), Sampling(temperature=0.0, ignore_eos=True),
              "stop_sequences", None)]
    for prompt, limit, sampling, param, code in steps:
        with pytest.raises(ApiError) as caught:
            generation_request(32, prompt, settings(sampling=sampling, limit=limit, stop=too_many_stops,
                                                    stop_param="stop_sequences"))
        assert (caught.value.param, caught.value.code) == (param, code)


def test_generation_request_carries_the_prompt_and_the_settings():
    gen = generation_request(32, PromptTokens("abc", (1, 2, 3), "prompt", user_boundary=1),
                             settings(limit=TokenLimit(None, None, "max_tokens"), sampling=Sampling(seed=-1),
                                      stop=["", "END"], top_logprobs=2, prompt_logprobs=0))
    assert (gen.prompt_text, gen.prompt_ids, gen.user_boundary) == ("abc", (1, 2, 3), 1)
    assert gen.max_tokens == 29  # no limit and no default: the room left
    assert gen.sampling == SamplingSpec(temperature=1.0, seed=2**63 - 1)
    assert (gen.stop, gen.top_logprobs, gen.prompt_logprobs) == (("END",), 2, 0)
    assert gen.new_splitter is None and gen.new_constraint is None


class UntokenizedModel:
    """A model whose tokenizer must not be reached."""
    n_ctx = 16
    max_token_bytes = 4

    def tokenize_prompt(self, text: str) -> list[int]:
        raise AssertionError("tokenized")


def test_a_prompt_too_long_to_fit_however_it_tokenizes_is_never_tokenized():
    with pytest.raises(ApiError) as caught:
        tokenize_prompt(UntokenizedModel(), "x" * 64, "input")
    assert (caught.value.param, caught.value.extra) == ("input", {"n_prompt_tokens_at_least": 16, "n_ctx": 16})


def test_output_rules_are_checked_together():
    tool = ToolSpec("get_weather", "", {"type": "object"})
    with pytest.raises(ApiError) as caught:
        OutputRules.checked(json_format=None, choice=ToolChoice("required"), tools=[], ignore_eos=False)
    assert caught.value.param == "tool_choice"
    with pytest.raises(ApiError) as caught:
        OutputRules.checked(json_format=None, choice=ToolChoice("required"), tools=[tool], ignore_eos=True)
    assert caught.value.param == "ignore_eos"
    rules = OutputRules.checked(json_format=None, choice=ToolChoice("none"), tools=[tool], ignore_eos=False)
    assert rules.tools == (tool,) and rules.shown_tools == []


def test_prepare_chat_renders_tokenizes_and_wires_the_splitter_and_constraint():
    model = FakeModel()
    tool = ToolSpec("get_weather", "", {"type": "object"})
    rules = OutputRules.checked(json_format=None, choice=ToolChoice("function", "get_weather"), tools=[tool],
                                ignore_eos=False)
    request = ChatRequest("anthropic", [Message("user", "hi")], rules, settings(sampling=Sampling()), "messages")
    gen = prepare_chat(model, ToolCalling("hermes"), request)
    assert gen.prompt_text == model.rendered[-1] and "get_weather" in gen.prompt_text
    assert list(gen.prompt_ids) == model.tokenize_prompt(gen.prompt_text)
    assert gen.new_constraint is not None  # a forced call
    splitter = gen.new_splitter()
    splitter.feed('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    (call,) = splitter.finish("stop").tool_calls
    assert call.id.startswith("toolu_")  # the API's own call-id prefix
