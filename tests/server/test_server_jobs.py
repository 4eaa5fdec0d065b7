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
