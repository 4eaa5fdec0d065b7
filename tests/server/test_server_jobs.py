"""`server.jobs.TokenDecoder` with a frontier row that lives on a device: the row is copied to
the host only for what needs the whole row (logprobs, token masks), never for plain sampling."""
from __future__ import annotations

import torch

from engine.device_sampling import DeviceLogits
from server.jobs import GenerationRequest, Job, TextDelta, TokenDecoder
from server_fake_engine import FakeModel


class RowOnDevice(DeviceLogits):
    """A device row (on the CPU here) that counts its copies to the host."""

    __slots__ = ("copies",)

    def __init__(self, row: torch.Tensor) -> None:
        top = int(row.argmax())
        super().__init__(row, top, top, frozenset())
        self.copies = 0

    def host(self) -> torch.Tensor:
        self.copies += 1
        return super().host()


def decoder_for(**request) -> tuple[TokenDecoder, list]:
    events: list = []
    req = GenerationRequest(prompt_text="", prompt_ids=(1,), max_tokens=8, **request)
    return TokenDecoder(FakeModel(), Job(1, req, events.append)), events


def peaked(token: int, n_vocab: int) -> torch.Tensor:
    row = torch.zeros(n_vocab)
    row[token] = 20.0
    return row


def test_plain_sampling_hands_the_row_to_the_sampler_without_a_copy():
    decoder, _ = decoder_for()
    row = RowOnDevice(peaked(ord("h"), decoder.model.n_vocab))
    seen = []
    token = decoder.choose(row, lambda r: seen.append(r) or r.argmax())
    assert token == ord("h") and seen == [row] and row.copies == 0


def test_logprobs_copy_the_row_once_and_describe_the_chosen_token():
    decoder, events = decoder_for(top_logprobs=2)
    row = RowOnDevice(peaked(ord("h"), decoder.model.n_vocab))
    token = decoder.choose(row, lambda r: r.argmax())
    assert row.copies == 1
    decoder.accept(token)
    (delta,) = [e for e in events if isinstance(e, TextDelta)]
    assert delta.text == "h" and delta.logprobs[0].token_id == ord("h")
    assert len(delta.logprobs[0].top) == 2 and delta.logprobs[0].logprob > -0.1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_coalescing_sink_merges_fast_deltas_and_sends_them_before_the_next_event():
    from server.jobs import CoalescingSink, Finished, TokenLogprob, Usage
    from server.tools import ContentDelta, ReasoningDelta

    sent: list = []
    clock = Clock()
    sink = CoalescingSink(sent.append, 0.010, clock)
    lp = [TokenLogprob(i, f"t{i}", -float(i)) for i in range(4)]
    sink(TextDelta("a", (lp[0],), (ReasoningDelta("a"),)))  # the first goes out at once
    assert sent == [TextDelta("a", (lp[0],), (ReasoningDelta("a"),))]
    clock.now += 0.004
    sink(TextDelta("b", (lp[1],), (ReasoningDelta("b"),)))
    clock.now += 0.004
    sink(TextDelta("c", (lp[2],), (ContentDelta("c"),)))
    assert len(sent) == 1  # both within 10 ms of "a": held
    clock.now += 0.004  # 12 ms after "a": the held text goes out with this one, in order
    sink(TextDelta("d", (lp[3],), (ContentDelta("d"),)))
    # adjacent text events of one kind become one
    assert sent[1] == TextDelta("bcd", (lp[1], lp[2], lp[3]), (ReasoningDelta("b"), ContentDelta("cd")))
    clock.now += 0.001
    sink(TextDelta("e"))
    done = Finished("stop", Usage(1, 5, 0))
    sink(done)  # what is held goes out first
    assert sent[2:] == [TextDelta("e"), done]
    assert "".join(e.text for e in sent if isinstance(e, TextDelta)) == "abcde"


def test_coalescing_sink_with_no_interval_passes_every_delta():
    from server.jobs import CoalescingSink

    sent: list = []
    sink = CoalescingSink(sent.append, 0.0, Clock())
    for text in "xyz":
        sink(TextDelta(text))
    assert [e.text for e in sent] == ["x", "y", "z"]


def test_joined_events_merge_only_adjacent_text_of_one_kind():
    from server.jobs import joined_events
    from server.tools import ContentDelta, ReasoningDelta, ToolCall, ToolCallEnd

    end = ToolCallEnd(0, ToolCall(id="c1", name="f", arguments={}))
    assert joined_events((ContentDelta("a"),), (ContentDelta("b"), end)) == (ContentDelta("ab"), end)
    assert joined_events((end,), (ContentDelta("b"),)) == (end, ContentDelta("b"))
    assert joined_events((ReasoningDelta("a"),), (ContentDelta("b"),)) == (ReasoningDelta("a"), ContentDelta("b"))
    assert joined_events((), (ContentDelta("b"),)) == (ContentDelta("b"),)


def test_the_decoder_follows_its_sampler_unless_a_constraint_or_a_tool_call_decides():
    """What ds4-server's batched jobs tell the scheduler's run-ahead (`follows_sampler`): plain
    requests draw with their sampler; a constraint may force or mask tokens, and inside a tool
    call the argmax is taken."""
    plain, _ = decoder_for()
    assert plain.follows_sampler
    constrained, _ = decoder_for(new_constraint=lambda model, splitter: object())
    assert not constrained.follows_sampler

    class Splitter:
        in_structure = False

    tools, _ = decoder_for(new_splitter=Splitter)
    assert tools.follows_sampler
    tools.splitter.in_structure = True
    assert not tools.follows_sampler
