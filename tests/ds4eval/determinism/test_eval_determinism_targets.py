"""HttpTarget against a small local server that answers like llama.cpp's: one choice whatever
`n` asks, log-probabilities only when asked, whole or streamed."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ds4eval.determinism.analysis import Group, analyze
from ds4eval.determinism.targets import HttpTarget, Request

TOKENS = [("The", -0.1, -2.6), (" sky", -0.3, -0.5), (" is", -0.01, -6.0)]


def _logprobs():
    return {"content": [{"token": t, "logprob": a, "top_logprobs": [{"token": t, "logprob": a},
                                                                     {"token": "x", "logprob": b}]}
                        for t, a, b in TOKENS]}


class OneChoice(BaseHTTPRequestHandler):
    with_logprobs = True

    def log_message(self, *args):
        pass

    def _send(self, code, body, content_type="application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "one-choice"}]}))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        logprobs = _logprobs() if body.get("logprobs") and self.with_logprobs else None
        text = "".join(t for t, _, _ in TOKENS)
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": "length"}
            self._send(200, json.dumps({"choices": [choice]}))
            return
        chunks = []
        for k, (t, a, b) in enumerate(TOKENS):
            lp = {"content": [_logprobs()["content"][k]]} if logprobs else None
            chunks.append({"choices": [{"index": 0, "delta": {"content": t}, "logprobs": lp,
                                        "finish_reason": "length" if k == len(TOKENS) - 1 else None}]})
        self._send(200, "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n",
                   "text/event-stream")


@pytest.fixture
def server():
    handler = type("Handler", (OneChoice,), {"with_logprobs": True})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield httpd, handler
    httpd.shutdown()
    httpd.server_close()


def target(httpd):
    return HttpTarget(f"http://127.0.0.1:{httpd.server_address[1]}")


def request(**kw):
    return Request("r", "sys", "user", max_tokens=3, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_and_top2_gaps_come_from_the_logprobs_whole_or_streamed(server, stream):
    t = target(server[0])
    assert t.served_model == "one-choice" and t.check_logprobs() is None
    [[c]] = t.generate([request(stream=stream)])
    assert c.tokens == ("The", " sky", " is") and c.text == "The sky is" and c.finish == "length"
    assert c.gaps == pytest.approx((2.5, 0.2, 5.99))


@pytest.mark.parametrize("stream", [False, True])
def test_a_stack_that_ignores_n_fails_the_missing_choice_instead_of_diverging(server, stream):
    t = target(server[0])
    [[first, second]] = t.generate([request(n=2, stream=stream)])
    assert first.error == "" and first.tokens == ("The", " sky", " is")
    assert second.error == "the answer has no choice 1 (2 asked for)"
    [[ref]] = t.generate([request()])
    outcome = analyze(Group("p", "n=2", (ref, first, second)))
    # The missing choice is a failed request, not a second completion parting at its first word.
    assert (outcome.distinct, outcome.divergence, outcome.unit, outcome.errors) == \
        (1, None, "token", ("r choice 1: the answer has no choice 1 (2 asked for)",))


def test_a_stack_without_logprobs_is_measured_by_word_and_says_so(server):
    server[1].with_logprobs = False
    t = target(server[0])
    assert "no log-probabilities" in t.check_logprobs()
    [[c]] = t.generate([request()])
    assert c.tokens is None and c.text == "The sky is"
