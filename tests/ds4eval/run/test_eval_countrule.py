"""Measuring whether a server counts the end-of-sequence token (`ds4eval.run.countrule`): the pure
judge, scripted servers of either rule (including one whose first answer differs), and the real
servers: llama-cpp-python's counts text only, ds4-server counts the token as it says it does."""

from __future__ import annotations

import json

import pytest

from ds4eval.config import EvalConfig
from ds4eval.run import countrule as cr
from ds4eval.run import provenance as pv
from ds4eval.run.backends.openai_backend import OpenAIBackend
from ds4eval.run.countrule import Answer, judge_counting

from openai_fakes import JsonHandler, serve, stop
from real_servers import LLAMA_CPP, served


def test_the_judge_reads_the_capped_answers_finish_reason():
    free = Answer("Blue.", "stop", 3)
    assert judge_counting(free, Answer("Blue.", "stop", 3)) == "yes"    # the text fit in C-1: EOS counted
    assert judge_counting(free, Answer("Blue.", "length", 3)) == "no"   # the text took all C
    assert judge_counting(free, Answer("Blue!", "length", 3)) == ""     # another text: nothing learnt
    assert judge_counting(Answer("Blue", "length", 64), free) == ""     # never ended by itself
    assert judge_counting(Answer("Blue.", "stop", None), free) == ""    # no usage
    assert judge_counting(Answer("", "stop", 0), Answer("", "stop", 0)) == "no"


def test_an_answer_is_read_from_a_chat_completion():
    doc = {"choices": [{"message": {"content": "Hi"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}
    assert cr.answer_of(doc) == Answer("Hi", "stop", 2)
    assert cr.answer_of({"choices": []}) is None and cr.answer_of([]) is None
    assert cr.answer_of({"choices": [{"message": {"content": None}, "finish_reason": "stop"}]}) == \
        Answer("", "stop", None)


class Scripted:
    """A chat server whose reply is `words` words (one token each) and then an end-of-sequence token,
    counted in its usage when `counts_eos`; `first` replaces the first answer's words."""

    def __init__(self, words: list[str], counts_eos: bool, first: list[str] | None = None):
        self.words, self.counts_eos, self.first = words, counts_eos, first
        self.budgets: list[int] = []

    def __enter__(self) -> "Scripted":
        fake = self

        class Handler(JsonHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                budget = body["max_tokens"]
                words = fake.first if fake.first and not fake.budgets else fake.words
                fake.budgets.append(budget)
                sampled = words + ["<eos>"]
                taken = sampled[:budget]
                ended = taken[-1] == "<eos>"
                text = taken[:-1] if ended else taken
                count = len(taken) if (fake.counts_eos or not ended) else len(text)
                self._json(200, {"choices": [{"message": {"content": " ".join(text)},
                                              "finish_reason": "stop" if ended else "length"}],
                                 "usage": {"completion_tokens": count}})

        self.server, self.thread, self.url = serve(Handler)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.server, self.thread)


@pytest.mark.parametrize("counts_eos, rule", [(True, "yes"), (False, "no")])
def test_the_measurement_tells_the_two_rules_apart(measures_counting, counts_eos, rule):
    with Scripted(["The", "sky", "is", "blue."], counts_eos) as fake:
        assert cr.measure_eos_counting.__wrapped__(fake.url + "/v1", "m") == rule
    # Two agreeing uncapped answers, then the capped one at the count they reported.
    assert fake.budgets == [cr.FREE_BUDGET, cr.FREE_BUDGET, 4 + counts_eos]


def test_a_first_answer_that_differs_is_asked_again(measures_counting):
    with Scripted(["Blue."], False, first=["It", "is", "blue."]) as fake:
        assert cr.measure_eos_counting.__wrapped__(fake.url, "m") == "no"
    assert fake.budgets == [cr.FREE_BUDGET] * 3 + [1]


def test_a_server_that_cannot_be_reached_leaves_the_rule_unknown(measures_counting):
    assert cr.measure_eos_counting.__wrapped__("http://127.0.0.1:9/v1", "m") == ""


def test_the_provenance_measures_only_when_the_listing_does_not_say(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    backend = OpenAIBackend(EvalConfig(backend="openai", urls=("http://127.0.0.1:9/v1",), served_model="m"))
    asked = []

    def measure(endpoint, model, api_key):
        asked.append((endpoint, model, api_key))
        return "no"

    assert pv.run_provenance(backend, api_key="k", fetch=lambda *_: None, measure=measure)["gen_tokens_eos"] == "no"
    assert asked == [("http://127.0.0.1:9/v1/chat/completions", "m", "k")]
    listing = {"data": [{"id": "m", "meta": {"completion_tokens_include_eos": True}}]}
    prov = pv.run_provenance(backend, fetch=lambda *_: listing, measure=lambda *_: pytest.fail("measured"))
    assert prov["gen_tokens_eos"] == "yes"
    backend.close()


@pytest.mark.model
@pytest.mark.skipif(LLAMA_CPP is None, reason="llama-cpp-python (extra 'llamacpp') missing")
def test_llama_cpp_python_counts_text_tokens_only_and_ds4_server_counts_the_eos(measures_counting, embedded_path):
    with served("llama.cpp", embedded_path) as url:
        assert cr.measure_eos_counting.__wrapped__(url, "") == "no"
    with served("ds4-server", embedded_path) as url:
        # ds4-server states its rule in /v1/models; the measurement agrees with what it states.
        assert cr.measure_eos_counting.__wrapped__(url, "") == "yes"
