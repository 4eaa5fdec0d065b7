"""OpenAI backend against a local scripted SSE server (http.server in a thread; no model)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ds4eval.cases.case import parse_case
from ds4eval.config import EvalConfig
from ds4eval.run.backends.openai_backend import OpenAIBackend, completions_url
from ds4eval.run.runner import Runner, Status


def chunk(**delta):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def finish(reason="stop"):
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 7}}


class Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the SSE script chosen by the question text."""

    scripts: dict = {}
    requests: list = []
    active = 0
    max_active = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.requests.append((self.path, dict(self.headers), body))
            cls.active += 1
            cls.max_active = max(cls.max_active, cls.active)
        try:
            question = body["messages"][1]["content"]
            key = next(k for k in cls.scripts if k in question)
            status, events = cls.scripts[key]
            if status != 200:
                data = json.dumps({"error": {"message": "prompt too long"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ev in events:
                if isinstance(ev, float):
                    import time

                    time.sleep(ev)
                    continue
                line = ev if isinstance(ev, str) else "data: " + json.dumps(ev)
                self.wfile.write((line + "\n\n").encode())
                self.wfile.flush()
        finally:
            with cls.lock:
                cls.active -= 1


@pytest.fixture
def server():
    Scripted.requests, Scripted.max_active = [], 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def case(name, answer="4"):
    return parse_case({"source": "toy", "id": name, "question": f"[{name}] what?", "answer": answer,
                       "answer_kind": "integer"})


def run(url, names, **cfg_kw):
    cfg = EvalConfig(backend="openai", urls=(url,), served_model="m", api_key="k", **cfg_kw)
    backend = OpenAIBackend(cfg)
    runner = Runner(cfg, [case(n) for n in names], backend)
    states = runner.run()
    backend.close()
    return {s.case.id: s for s in states}


def test_streaming_reasoning_usage_and_request_body(server):
    Scripted.scripts = {"[ok]": (200, [": keep-alive", chunk(role="assistant"), chunk(reasoning_content="2+2"),
                                       chunk(reasoning_content="=4"), chunk(content="Answer: "),
                                       chunk(content="4"), finish(), USAGE, "data: [DONE]"])}
    st = run(server, ["ok"], seed=7, temperature=0.5, min_p=0.05, think=False, tokens=99)["ok"]
    assert st.status is Status.PASSED
    assert st.output == "<think>2+2=4</think>Answer: 4" and st.think_close == "natural"
    assert (st.prompt_tokens, st.gen_tokens) == (42, 7)
    path, headers, body = Scripted.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 99 and body["seed"] == 7 and body["min_p"] == 0.05 and body["model"] == "m"
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["messages"][0]["role"] == "system" and "Answer: N" in body["messages"][1]["content"]


@pytest.mark.parametrize("events, status, msg", [
    ([chunk(content="Answer: 4"), finish()], 200, "without [DONE]"),
    ([chunk(content="Answer: 4"), "data: [DONE]"], 200, "finish reason"),
    ([chunk(content="Answer: 4"), "data: {broken", "data: [DONE]"], 200, "broken JSON"),
    ([{"error": {"message": "overloaded"}}, "data: [DONE]"], 200, "overloaded"),
    ([], 400, "HTTP 400: prompt too long"),
])
def test_incomplete_or_failed_streams_are_errors(server, events, status, msg):
    Scripted.scripts = {"[bad]": (status, events)}
    st = run(server, ["bad"])["bad"]
    assert st.status is Status.ERROR and msg in st.error


def test_concurrency_sends_cases_at_once(server):
    slow = [0.15, chunk(content="Answer: 4"), finish(), "data: [DONE]"]
    Scripted.scripts = {f"[s{i}]": (200, slow) for i in range(4)}
    states = run(server, [f"s{i}" for i in range(4)], concurrency=4)
    assert all(s.status is Status.PASSED for s in states.values())
    assert Scripted.max_active >= 2


def test_a_server_that_refuses_connections_stops_the_case_after_the_endpoint_wait():
    # Retried, taken out of rotation, re-probed for --endpoint-wait, then stopped for `retry`:
    # never an ERROR, which would count as the model's doing in a comparison.
    states = run("http://127.0.0.1:9", ["x", "y"], endpoint_wait_s=0.3)
    for st in states.values():
        assert st.status is Status.STOPPED and st.output == ""
    assert "ConnectError" in states["x"].error and "no endpoint has answered for 0.3 s" in states["x"].error
    assert states["y"].error == "no endpoint has answered for 0.3 s"


def test_completions_url():
    assert completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert completions_url("http://h/x/chat/completions") == "http://h/x/chat/completions"


# ---------------------------------------------------------------- probe, request fields, token counts

from ds4eval.run.backends import BackendUnavailable, create_backend  # noqa: E402
from ds4eval.run.backends.openai_backend import models_url  # noqa: E402
from openai_fakes import FakeOpenAI  # noqa: E402


def test_models_url():
    assert models_url("http://h:1") == "http://h:1/v1/models"
    assert models_url("http://h:1/v1/") == "http://h:1/v1/models"
    assert models_url("http://h/x/v1/chat/completions") == "http://h/x/v1/models"


def test_probe_takes_the_served_model_id():
    with FakeOpenAI(models=("Qwen3-8B-Q4_K_M.gguf", "other")) as srv:
        backend = create_backend(EvalConfig(backend="openai", urls=(srv.url,)))
        try:
            assert backend.model_name == "Qwen3-8B-Q4_K_M.gguf"
            runner = Runner(backend.config, [case("x")], backend)
            [st] = runner.run()
            assert st.status is Status.PASSED
            assert srv.bodies[0]["model"] == "Qwen3-8B-Q4_K_M.gguf"
            assert runner.trace_record(st).model == "Qwen3-8B-Q4_K_M.gguf"
        finally:
            backend.close()


def test_served_model_flag_wins_and_a_server_without_a_model_list_is_usable():
    with FakeOpenAI(models=None) as srv:
        backend = create_backend(EvalConfig(backend="openai", urls=(srv.url,)))
        assert backend.model_name == "default"
        backend.close()
    with FakeOpenAI() as srv:
        backend = create_backend(EvalConfig(backend="openai", urls=(srv.url,), served_model="mine"))
        assert backend.model_name == "mine" and backend.request_model == "mine"
        backend.close()


def test_probe_failures_are_one_line():
    with pytest.raises(BackendUnavailable, match=r"^cannot reach the server at http://127.0.0.1:9: connection refused$"):
        create_backend(EvalConfig(backend="openai", urls=("http://127.0.0.1:9",)))
    with FakeOpenAI(models_status=401) as srv:
        with pytest.raises(BackendUnavailable, match="refused the request .HTTP 401: invalid api key.; check --api-key"):
            create_backend(EvalConfig(backend="openai", urls=(srv.url,)))


def test_request_extra_and_chat_template_kwargs_are_merged_into_the_body():
    cfg = EvalConfig(backend="openai", urls=("http://h:1",), think=False,
                     request_extra='{"repeat_penalty": 1.0, "temperature": 0.3, "chat_template_kwargs": {"x": 1}}',
                     chat_template_kwargs='{"reasoning_effort": "low"}')
    backend = OpenAIBackend(cfg)
    runner = Runner(cfg, [case("x")], backend)
    body = backend.request_body(runner.job(runner.states[0]))
    backend.close()
    assert body["repeat_penalty"] == 1.0 and body["temperature"] == 0.3  # --request-extra wins
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "low", "x": 1}
    assert body["stream"] is True and body["messages"][1]["role"] == "user"


def test_without_usage_token_counts_are_unknown_not_chunk_counts():
    with FakeOpenAI(usage=False, reply=lambda q: "Answer: 4 because two and two") as srv:
        st = run(srv.url, ["x"])["x"]
    assert st.status is Status.PASSED
    assert st.tokens_known is False and st.gen_tokens == 0 and st.prompt_tokens == 0


def test_without_usage_a_tokenizer_counts_the_tokens():
    class Counter:
        def prompt_tokens(self, system, question):
            return 100

        def output_tokens(self, text):
            return len(text.split())

        def rendered_prompt(self, system, question):
            return None

    with FakeOpenAI(usage=False, reply=lambda q: "Answer: 4 because two and two") as srv:
        cfg = EvalConfig(backend="openai", urls=(srv.url,))
        backend = OpenAIBackend(cfg)
        backend.counter = Counter()
        [st] = Runner(cfg, [case("x")], backend).run()
        backend.close()
    assert st.tokens_known and (st.prompt_tokens, st.gen_tokens) == (100, 6)


@pytest.mark.model
def test_a_tokenizer_gives_a_server_run_the_engines_prompt_hash(embedded_path):
    """With --tokenizer, a server run records the prompt as the model's template renders it: the
    same hash and text the engine backend records, so two stacks' traces line up case by case."""
    import engine

    from ds4eval.run.backends.engine_backend import EngineBackend

    with FakeOpenAI(reply=lambda q: "Answer: 4") as srv:
        cfg = EvalConfig(backend="openai", urls=(srv.url,), tokenizer=embedded_path)
        backend = OpenAIBackend(cfg)
        [served] = Runner(cfg, [case("x")], backend).run()
        backend.close()
    local = EngineBackend(engine.load_model(embedded_path), engine)
    [alone] = Runner(EvalConfig(tokens=1), [case("x")], local).run()
    assert served.prompt is not None and served.prompt.sha256
    assert (served.prompt.sha256, served.prompt.text, served.prompt.ends) == \
        (alone.prompt.sha256, alone.prompt.text, alone.prompt.ends)


def _repeat_run(srv, **kw):
    cfg = EvalConfig(backend="openai", urls=(srv.url,), served_model="m", repeats=3, temperature=0.7, seed=10, **kw)
    backend = OpenAIBackend(cfg)
    runner = Runner(cfg, [case("a"), case("b")], backend)
    states = runner.run()
    backend.close()
    return states, backend


def test_repeats_go_out_as_one_request_with_n_and_come_back_per_choice():
    with FakeOpenAI(reply=lambda q, i: f"sample {i}\nAnswer: {4 if i != 1 else 5}") as srv:
        states, backend = _repeat_run(srv)
    assert backend.n_supported is True
    assert [b.get("n") for b in srv.bodies] == [3, 3] and [b["seed"] for b in srv.bodies] == [10, 10]
    by = {(s.case.id, s.repeat): s for s in states}
    assert len(by) == 6
    for cid in ("a", "b"):
        assert [by[(cid, r)].output for r in range(3)] == [f"sample {r}\nAnswer: {4 if r != 1 else 5}"
                                                          for r in range(3)]
        assert [by[(cid, r)].status.value for r in range(3)] == ["PASSED", "FAILED", "PASSED"]
        # The usage chunk totals all choices: the prompt is known, each choice's share is not.
        assert all(by[(cid, r)].prompt_tokens == 11 and not by[(cid, r)].tokens_known for r in range(3))


def test_a_server_that_refuses_n_gets_one_request_per_repeat_with_its_own_seed():
    with FakeOpenAI(takes_n=False) as srv:
        states, backend = _repeat_run(srv)
    assert backend.n_supported is False
    # The refused n=3 request, then one request per repeat, each repeat with seed + r.
    assert [b.get("n", 1) for b in srv.bodies] == [3, 1, 1, 1, 1, 1, 1]
    assert [b["seed"] for b in srv.bodies[1:]] == [10, 11, 12, 10, 11, 12]
    assert all(s.status.value == "PASSED" and s.tokens_known for s in states)


# ---------------------------------------------------------------- latency under a server that takes its time

def test_latency_is_measured_from_the_stream_of_a_slow_server(server, tmp_path):
    # 0.2 s before the first token, then five one-token chunks 0.05 s apart with one 0.3 s
    # stall among them; usage says 6 tokens. Bounds are lower bounds (sleeps only add time).
    events = [chunk(role="assistant"), 0.2, chunk(reasoning_content="2+2")]
    for i, piece in enumerate(["=4", "Answer: ", "4", ".", ""]):
        events += [0.3 if i == 2 else 0.05, chunk(content=piece) if piece else chunk(content=" ")]
    events += [finish(), {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}, 0.1, "data: [DONE]"]
    Scripted.scripts = {"[slow]": (200, events), "[fast]": (200, [chunk(content="Answer: 4"), finish(),
                                                                  "data: [DONE]"])}
    trace = tmp_path / "t.trace"
    states = run(server, ["slow", "fast"], concurrency=2, trace=str(trace))
    lat = states["slow"].latency
    assert states["slow"].status is Status.PASSED
    assert 0.2 <= lat.ttft_s < 5
    assert lat.itl_per == "token" and lat.itl_s >= (4 * 0.05 + 0.3) / 5 * 0.8
    assert lat.itl_max_s >= 0.25 and lat.itl_max_s >= lat.itl_s
    assert lat.e2e_s >= 0.2 + 4 * 0.05 + 0.3 + 0.1 and lat.e2e_s >= lat.ttft_s
    fast = states["fast"].latency  # one chunk: a first token, no gap
    assert fast.ttft_s is not None and fast.itl_s is None and fast.e2e_s >= fast.ttft_s

    from ds4eval.run.trace import read_trace

    records = {r.id: r for r in read_trace(trace).records}
    written = records["slow"].latency()
    assert written.itl_per == "token" and records["slow"].concurrency == 2
    for name in ("ttft_s", "itl_s", "itl_max_s", "e2e_s"):
        assert getattr(written, name) == pytest.approx(getattr(lat, name), abs=1e-6)  # microseconds
    assert records["fast"].concurrency == 2


def test_without_usage_the_gaps_are_per_chunk(server):
    events = [chunk(content="Answer"), 0.05, chunk(content=": "), 0.05, chunk(content="4"), finish(), "data: [DONE]"]
    Scripted.scripts = {"[chunky]": (200, events)}
    lat = run(server, ["chunky"])["chunky"].latency
    assert lat.itl_per == "chunk" and lat.itl_s >= 0.04
