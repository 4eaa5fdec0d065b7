"""The SSE stream writers of the four APIs on scripted worker events: the exact bytes they send;
and the writer base that dispatches each event to its method.

Each test feeds a fixed sequence of worker events (keepalive ticks, `PromptReady`, `TextDelta`s
carrying splitter events, `Finished` / `Failed`) to an API's stream and compares what comes out
byte for byte, so that a change of order, of a field or of the JSON spacing shows. Ids that the
writers make themselves are drawn from a counter instead of the CSPRNG."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator, Iterable

import pytest

from server import api_anthropic, api_openai, api_responses
from server.apibase import StreamWriter, writes
from server.choices import ChoiceEvent
from server.jobs import Failed, Finished, PromptReady, TextDelta, TokenLogprob, Usage
from server.prompting import ContentDelta, ParsedOutput, ReasoningDelta, ToolCallEnd
from server.scoring import PromptScored
from server.sse import DONE, KEEPALIVE, sse_data, sse_event
from server.tools.records import ToolCall

CALL = ToolCall("call_1", "get_weather", {"city": "Paris"})
USAGE = Usage(prompt_tokens=21, completion_tokens=4, cached_tokens=5, cache_written_tokens=3)


def written(stream: AsyncIterator[bytes]) -> list[bytes]:
    async def drain() -> list[bytes]:
        return [frame async for frame in stream]
    return asyncio.run(drain())


async def scripted(events: Iterable[Any]) -> AsyncIterator[Any]:
    for event in events:
        yield event


def text(*out_events: Any, chars: str = "") -> TextDelta:
    return TextDelta(chars, (), tuple(out_events))


def events(*pairs: tuple[str, dict[str, Any]]) -> list[bytes]:
    """Expected named SSE frames, framed by the one SSE framing function."""
    return [sse_event(name, payload) for name, payload in pairs]


@pytest.fixture
def counted_ids(monkeypatch):
    """Item ids of the Responses stream as prefix + 0, 1, 2, ..."""
    n = itertools.count()
    monkeypatch.setattr(api_responses, "new_id", lambda prefix: f"{prefix}{next(n)}")


# --- Anthropic Messages ----------------------------------------------------------------------

ANTHROPIC = api_anthropic.AnthropicContext(model_name="m", id="msg_1", n_prompt=21)


def anthropic(events_in: Iterable[Any]) -> list[bytes]:
    return written(api_anthropic.messages_stream(ANTHROPIC, scripted(events_in)))


def test_messages_stream_thinking_text_and_a_call_byte_for_byte():
    frames = anthropic([
        None, PromptReady(21, 5, 3), text(ReasoningDelta("hm")), PromptReady(21, 9, 9),
        text(ContentDelta("Hi"), chars="Hi"), text(ToolCallEnd(0, CALL)),
        Finished("stop", USAGE, None, ParsedOutput(content="Hi", reasoning="hm", tool_calls=[CALL],
                                                   finish_reason="tool_calls"))])
    usage = (b'"usage":{"input_tokens":13,"cache_creation_input_tokens":3,"cache_read_input_tokens":5,'
             b'"output_tokens":%d}')
    assert frames == [
        b": prefill\n\n",
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
        b'"role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,'
        + usage % 0 + b"}}\n\n",
        b'event: ping\ndata: {"type":"ping"}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"hm"}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"signature_delta","signature":""}}\n\n',
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        b'"content_block":{"type":"text","text":""}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"text_delta","text":"Hi"}}\n\n',
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n',
        b'event: content_block_start\ndata: {"type":"content_block_start","index":2,'
        b'"content_block":{"type":"tool_use","id":"call_1","name":"get_weather","input":{}}}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":2,'
        b'"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": \\"Paris\\"}"}}\n\n',
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":2}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use",'
        b'"stop_sequence":null},' + usage % 4 + b"}\n\n",
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ]


def test_messages_stream_started_by_the_end_when_no_prompt_ready_came():
    # The end's own text continues the block that is open.
    parsed = ParsedOutput(content="ab", finish_reason="stop", events=[ContentDelta("b")])
    frames = anthropic([text(ContentDelta("a")), Finished("stop", USAGE, "END", parsed)])
    usage = api_anthropic.usage_json(USAGE)
    assert frames == events(
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "a"}}),
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage | {"output_tokens": 0,
                                                                          "input_tokens": 13}}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "b"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "stop_sequence",
                                                              "stop_sequence": "END"}, "usage": usage}),
        ("message_stop", {"type": "message_stop"}))


@pytest.mark.parametrize("end,kind,message", [
    (Failed("out of memory"), "api_error", "out of memory"),
    (Finished("cancelled", USAGE), "overloaded_error",
     "the request was cancelled because the server is shutting down"),
])
def test_messages_stream_ends_with_one_error_event(end, kind, message):
    frames = anthropic([PromptReady(21, 0), text(ContentDelta("a")), end, text(ContentDelta("never"))])
    assert frames[-1] == sse_event("error", {"type": "error", "error": {"type": kind, "message": message}})
    assert [f.split(b"\n")[0] for f in frames] == [
        b"event: message_start", b"event: ping", b"event: content_block_start", b"event: content_block_delta",
        b"event: error"]


# --- OpenAI Responses ------------------------------------------------------------------------

RESPONSES = api_responses.ResponsesContext(model_name="m", id="resp_1", created_at=7, request_echo={"tools": []})


def responses(events_in: Iterable[Any]) -> list[bytes]:
    return written(api_responses.responses_stream(RESPONSES, scripted(events_in)))


def envelope(status: str, output: list[dict[str, Any]], usage: Usage | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 7, "status": status, "model": "m",
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "metadata": {}, "store": False, "truncation": "disabled", "text": {"format": {"type": "text"}},
            "reasoning": None, "usage": api_responses.usage_json(usage) if usage else None, "tools": []}


def numbered(*pairs: tuple[str, dict[str, Any]]) -> list[bytes]:
    """Responses frames: each payload gets its type and the next sequence number first."""
    return events(*((name, {"type": name, "sequence_number": i, **payload})
                    for i, (name, payload) in enumerate(pairs)))


START = (("response.created", {"response": envelope("in_progress", [])}),
         ("response.in_progress", {"response": envelope("in_progress", [])}))


def message_events(index: int, item_id: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    """The events of one streamed message item at `index` whose text came as one delta (none if empty)."""
    at = {"item_id": item_id, "output_index": index, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    deltas = [("response.output_text.delta", at | {"delta": text, "logprobs": []})] if text else []
    return [
        ("response.output_item.added", {"output_index": index, "item": {
            "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}}),
        ("response.content_part.added", at | {"part": part}),
        *deltas,
        ("response.output_text.done", at | {"text": text, "logprobs": []}),
        ("response.content_part.done", at | {"part": part | {"text": text}}),
        ("response.output_item.done", {"output_index": index, "item": api_responses.message_item(item_id, text)}),
    ]


def test_responses_stream_reasoning_then_text_at_the_limit_byte_for_byte(counted_ids):
    frames = responses([text(ReasoningDelta("hm")), text(ContentDelta("Hi"), chars="Hi"),
                        Finished("length", USAGE, None, ParsedOutput(content="Hi", reasoning="hm",
                                                                     finish_reason="length"))])
    head = b'"id":"resp_1","object":"response","created_at":7,"status":"%s","model":"m","output":%s,"error":null,'
    tail = (b'"metadata":{},"store":false,"truncation":"disabled","text":{"format":{"type":"text"}},'
            b'"reasoning":null,"usage":%s,"tools":[]')
    message = (b'{"type":"message","id":"msg_1","status":"incomplete","role":"assistant",'
               b'"content":[{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}]}')
    reasoning = b'{"type":"reasoning","id":"rs_0","summary":[],"content":[{"type":"reasoning_text","text":"hm"}]}'
    usage = (b'{"input_tokens":21,"input_tokens_details":{"cached_tokens":5},"output_tokens":4,'
             b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":25}')
    started = head % (b"in_progress", b"[]") + b'"incomplete_details":null,' + tail % b"null"
    assert frames == [
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{'
        + started + b"}}\n\n",
        b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,"response":{'
        + started + b"}}\n\n",
        b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":2,'
        b'"output_index":0,"item":{"type":"reasoning","id":"rs_0","summary":[],"content":[]}}\n\n',
        b'event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","sequence_number":3,'
        b'"item_id":"rs_0","output_index":0,"content_index":0,"delta":"hm"}\n\n',
        b'event: response.reasoning_text.done\ndata: {"type":"response.reasoning_text.done","sequence_number":4,'
        b'"item_id":"rs_0","output_index":0,"content_index":0,"text":"hm"}\n\n',
        b'event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":5,'
        b'"output_index":0,"item":' + reasoning + b"}\n\n",
        b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":6,'
        b'"output_index":1,"item":{"type":"message","id":"msg_1","status":"in_progress","role":"assistant",'
        b'"content":[]}}\n\n',
        b'event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number":7,'
        b'"item_id":"msg_1","output_index":1,"content_index":0,'
        b'"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n',
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":8,'
        b'"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Hi","logprobs":[]}\n\n',
        b'event: response.output_text.done\ndata: {"type":"response.output_text.done","sequence_number":9,'
        b'"item_id":"msg_1","output_index":1,"content_index":0,"text":"Hi","logprobs":[]}\n\n',
        b'event: response.content_part.done\ndata: {"type":"response.content_part.done","sequence_number":10,'
        b'"item_id":"msg_1","output_index":1,"content_index":0,'
        b'"part":{"type":"output_text","text":"Hi","annotations":[],"logprobs":[]}}\n\n',
        b'event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":11,'
        b'"output_index":1,"item":' + message + b"}\n\n",
        b'event: response.incomplete\ndata: {"type":"response.incomplete","sequence_number":12,"response":{'
        + head % (b"incomplete", b"[" + reasoning + b"," + message + b"]")
        + b'"incomplete_details":{"reason":"max_output_tokens"},' + tail % usage + b"}}\n\n",
    ]


def test_responses_stream_a_call_between_two_texts(counted_ids):
    parsed = ParsedOutput(content="ab", tool_calls=[CALL], finish_reason="tool_calls", events=[ContentDelta("b")])
    frames = responses([None, text(ContentDelta("a")), text(ToolCallEnd(0, CALL)),
                        Finished("stop", USAGE, None, parsed)])
    call_item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Paris"}', "status": "completed"}
    first = api_responses.message_item("msg_0", "a")
    second = api_responses.message_item("msg_2", "b")
    assert frames[2] == KEEPALIVE
    assert frames[:2] + frames[3:] == numbered(
        *START,
        *message_events(0, "msg_0", "a"),
        ("response.output_item.added", {"output_index": 1, "item": call_item | {"status": "in_progress",
                                                                                "arguments": ""}}),
        ("response.function_call_arguments.delta", {"item_id": "fc_1", "output_index": 1,
                                                    "delta": '{"city": "Paris"}'}),
        ("response.function_call_arguments.done", {"item_id": "fc_1", "output_index": 1, "name": "get_weather",
                                                   "arguments": '{"city": "Paris"}'}),
        ("response.output_item.done", {"output_index": 1, "item": call_item}),
        *message_events(2, "msg_2", "b"),
        ("response.completed", {"response": envelope("completed", [first, call_item, second], USAGE)}))


def test_responses_stream_without_output_still_sends_one_empty_message(counted_ids):
    frames = responses([Finished("stop", USAGE, None, ParsedOutput())])
    assert frames == numbered(
        *START,
        *message_events(0, "msg_0", ""),
        ("response.completed", {"response": envelope("completed", [api_responses.message_item("msg_0", "")],
                                                     USAGE)}))


@pytest.mark.parametrize("end,code,message", [
    (Failed("out of memory"), "server_error", "out of memory"),
    (Finished("cancelled", USAGE), "server_shutting_down",
     "the request was cancelled because the server is shutting down"),
])
def test_responses_stream_fails_with_the_output_so_far(counted_ids, end, code, message):
    call_item = api_responses.function_call_item("fc_0", CALL)
    frames = responses([text(ToolCallEnd(0, CALL)), text(ContentDelta("open")), end, text(ContentDelta("never"))])
    # Nine frames before the end (start, the call's four, the message's three); the open message is
    # not part of the failed response, only finished items are.
    assert len(frames) == 11
    assert frames[9:] == events(
        ("error", {"type": "error", "sequence_number": 9, "code": code, "message": message, "param": None}),
        ("response.failed", {"type": "response.failed", "sequence_number": 10, "response": envelope(
            "failed", [call_item], None, {"code": "server_error", "message": message})}))


# --- OpenAI Chat Completions and Completions -------------------------------------------------

def openai_ctx(kind: str, **kw: Any) -> api_openai.OpenAIContext:
    fields = {"model_name": "m", "id": "id-1", "created": 5, "include_usage": False, "logprobs": False} | kw
    return api_openai.OpenAIContext(kind=kind, **fields)


BASE_CHAT = {"id": "id-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
             "system_fingerprint": None}
BASE_COMPLETION = BASE_CHAT | {"object": "text_completion"}
LOGPROB = TokenLogprob(7, "Hi", -0.25, ((7, "Hi", -0.25), (8, "Ho", -1.5)))


def chat_chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               **extra: Any) -> bytes:
    return sse_data(BASE_CHAT | {"choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}]} | extra)


def test_chat_stream_two_choices_with_logprobs_and_usage():
    ctx = openai_ctx("chat", include_usage=True, logprobs=True, n=2, n_choices=2)
    u0, u1 = Usage(21, 2, 5), Usage(21, 3, 0)  # the prompt counts once, as choice 0 has it
    end = ParsedOutput(content="Hi!", finish_reason="stop", events=[ContentDelta("!")])
    frames = written(api_openai.chat_stream(ctx, scripted([
        None,
        ChoiceEvent(1, TextDelta("Hi", (LOGPROB,), (ContentDelta("H"), ContentDelta("i")))),
        ChoiceEvent(0, TextDelta("", (), (ReasoningDelta("hm"),))),
        ChoiceEvent(0, TextDelta("", (), (ToolCallEnd(0, CALL),))),
        ChoiceEvent(1, Finished("stop", u1, None, end)),
        ChoiceEvent(0, Finished("stop", u0, None, ParsedOutput(tool_calls=[CALL], finish_reason="tool_calls"))),
    ])))
    lp = {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
        {"token": "Ho", "logprob": -1.5, "bytes": [72, 111]}]}],
          "refusal": None}
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    usage = {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26,
             "prompt_tokens_details": {"cached_tokens": 5}}
    assert frames == [
        chat_chunk(0, {"role": "assistant", "content": ""}, usage=None),
        chat_chunk(1, {"role": "assistant", "content": ""}, usage=None),
        KEEPALIVE,
        chat_chunk(1, {"content": "H"}, logprobs=lp, usage=None),
        chat_chunk(1, {"content": "i"}, usage=None),
        chat_chunk(0, {"reasoning_content": "hm"}, usage=None),
        chat_chunk(0, {"tool_calls": [call]}, usage=None),
        chat_chunk(1, {"content": "!"}, usage=None),
        chat_chunk(1, {}, "stop", usage=None),
        chat_chunk(0, {}, "tool_calls", usage=None),
        sse_data(BASE_CHAT | {"choices": [], "usage": usage}),
        DONE,
    ]


def test_chat_stream_logprobs_without_text_ride_on_an_empty_delta_and_a_failure_ends_it():
    ctx = openai_ctx("chat", logprobs=True)
    frames = written(api_openai.chat_stream(ctx, scripted([
        ChoiceEvent(0, TextDelta("", (LOGPROB,), ())), ChoiceEvent(0, Failed("out of memory")),
        ChoiceEvent(0, TextDelta("never", (), (ContentDelta("never"),)))])))
    assert frames[1] == chat_chunk(0, {"content": ""}, logprobs=api_openai.chat_logprobs_json([LOGPROB]))
    assert frames[2:] == [sse_data({"error": {"message": "out of memory", "type": "server_error", "param": None,
                                              "code": "inference_failed"}})]


def completion_chunk(index: int, text_: str, finish: str | None = None, logprobs: Any = None) -> bytes:
    return sse_data(BASE_COMPLETION | {"choices": [{"index": index, "text": text_, "logprobs": logprobs,
                                                    "finish_reason": finish}]})


def test_completion_stream_echo_waits_for_the_prompt_scores():
    ctx = openai_ctx("completion", logprobs=True, echo_texts=("ab",))
    scored = PromptScored(1, "a", (TokenLogprob(2, "b", -0.5),))
    generated = TokenLogprob(3, "c", -0.75)
    frames = written(api_openai.completion_stream(ctx, scripted([
        ChoiceEvent(0, scored), ChoiceEvent(0, TextDelta("c", (generated,))),
        ChoiceEvent(0, Finished("length", Usage(2, 1, 0)))])))
    assert frames == [
        completion_chunk(0, "ab", logprobs={"tokens": ["a", "b"], "token_logprobs": [None, -0.5],
                                            "top_logprobs": [None, {"b": -0.5}], "text_offset": [0, 1]}),
        completion_chunk(0, "c", logprobs={"tokens": ["c"], "token_logprobs": [-0.75],
                                           "top_logprobs": [{"c": -0.75}], "text_offset": [2]}),
        completion_chunk(0, "", "length"),
        DONE,
    ]


def test_completion_stream_echoes_at_once_without_logprobs_and_skips_empty_text():
    ctx = openai_ctx("completion", n_choices=2, echo_texts=("ab", ""))
    frames = written(api_openai.completion_stream(ctx, scripted([
        ChoiceEvent(1, TextDelta("x")), ChoiceEvent(0, TextDelta("")),
        ChoiceEvent(0, Finished("cancelled", Usage(2, 0, 0))),
        ChoiceEvent(1, TextDelta("never"))])))
    assert frames == [
        completion_chunk(0, "ab"),
        completion_chunk(1, "x"),
        api_openai.stream_error(api_openai.CANCELLED),
    ]


# --- the writer base (server.apibase.StreamWriter) -------------------------------------------

class Tally(StreamWriter):
    """A writer over plain values: ints are counted, strings end the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def opening(self) -> list[bytes]:
        return [b"open\n"]

    def closing(self) -> list[bytes]:
        return [b"total %d\n" % self.count]

    @writes(int)
    def number(self, n: int, *scale: int) -> list[bytes]:
        self.count += n * (scale[0] if scale else 1)
        return [b"n %d\n" % n]

    @writes(tuple)
    def scaled(self, pair: tuple[int, int]) -> list[bytes]:
        return self.write(pair[0], pair[1])  # extra arguments reach the event's method

    @writes(str)
    def stop(self, text: str) -> list[bytes]:
        return self.end(text.encode())


def test_each_event_goes_to_its_method_and_unknown_kinds_are_skipped():
    assert written(Tally().stream(scripted([1, None, 2.5, (2, 10), 3]))) == [
        b"open\n", b"n 1\n", KEEPALIVE, b"n 2\n", b"n 3\n", b"total 24\n"]


def test_a_method_that_ends_the_stream_drops_the_rest_and_the_closing():
    assert written(Tally().stream(scripted([1, "failed\n", 2, None]))) == [b"open\n", b"n 1\n", b"failed\n"]


class LoudTally(Tally):
    @writes(int)
    def loud(self, n: int, *scale: int) -> list[bytes]:
        return [b"N %d\n" % n]

    def stop(self, text: str) -> list[bytes]:  # an override of a registered method, by its name
        return self.end(text.upper().encode())


def test_a_subclass_method_replaces_its_base_for_that_kind_only():
    assert written(LoudTally().stream(scripted([1, (2, 3), "end\n"]))) == [b"open\n", b"N 1\n", b"N 2\n", b"END\n"]
    assert written(Tally().stream(scripted([1, "end\n"]))) == [b"open\n", b"n 1\n", b"end\n"]
