"""ds4-bench serve against a scripted SSE server on loopback: stream rules, statistics, schedules, goodput."""
from __future__ import annotations

import asyncio
import csv
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import serve as sv

# ---------------------------------------------------------------- a scripted server


def chat_chunk(content=None, finish=None):
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": None}


USAGE = {"object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


def data(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


GOOD = [data(chat_chunk("")), data(chat_chunk("a")), data(chat_chunk("b")), data(chat_chunk("c")),
        data(chat_chunk(None, "length")), data(USAGE), b"data: [DONE]\n\n"]
SCRIPTS = {
    "good": GOOD,
    "no_done": GOOD[:-1],
    "no_usage": GOOD[:5] + GOOD[6:],
    "no_finish": GOOD[:4] + GOOD[5:],
    "broken_json": GOOD[:2] + [b'data: {"choices": [\n\n'] + GOOD[2:],
    "error_event": GOOD[:2] + [b'event: error\ndata: {"message": "boom"}\n\n'],
    "error_data": GOOD[:2] + [data({"error": {"message": "worker died", "type": "server_error"}})],
    "no_output": [data(chat_chunk("")), data(chat_chunk(None, "stop")), data(USAGE), b"data: [DONE]\n\n"],
}


class ScriptedServer:
    """Answers POSTs with the SSE script of the request's turn; `gap` seconds between events."""

    def __init__(self, plan, gap=0.0, status=200):
        self.plan, self.gap, self.status = list(plan), gap, status
        self.count = 0
        self.bodies = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": "scripted-model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n))
                with owner.lock:
                    turn = owner.count
                    owner.count += 1
                    owner.bodies.append(req)
                name = owner.plan[turn % len(owner.plan)]
                if owner.status != 200:
                    body = b'{"error": {"message": "overloaded"}}'
                    self.send_response(owner.status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in SCRIPTS[name]:
                    if owner.gap:
                        time.sleep(owner.gap)
                    self.wfile.write(event)
                    self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def run(cfg: sv.ServeBenchConfig) -> sv.ServeBenchResult:
    return asyncio.run(sv.run_serve_bench_async(cfg, progress_stream=open("/dev/null", "w")))


# ---------------------------------------------------------------- stream rules (pure)

def timed(events: list[bytes], dt: float = 0.01) -> list[tuple[float, str]]:
    lines, t = [], 0.0
    for ev in events:
        t += dt
        for line in ev.decode().split("\n")[:-1]:
            lines.append((t, line))
    return lines


def test_good_stream_gives_latencies_from_output_chunks_only():
    r = sv.parse_stream(timed(GOOD, 0.1))
    assert r.ok and r.error == ""
    assert r.completion_tokens == 3 and r.prompt_tokens == 10 and r.finish_reason == "length"
    # The role chunk at 0.1 s carries no text; "a" arrives at 0.2 s.
    assert r.ttft_s == pytest.approx(0.2)
    assert r.itl_s == pytest.approx([0.1, 0.1])
    assert r.e2el_s == pytest.approx(0.7)
    assert r.tpot_s == pytest.approx((0.7 - 0.2) / 2)


@pytest.mark.parametrize("name,reason", [
    ("no_done", "without [DONE]"), ("no_usage", "no usage"), ("no_finish", "no finish_reason"),
    ("broken_json", "broken JSON"), ("error_event", "error event"), ("error_data", "worker died"),
    ("no_output", "no output")])
def test_broken_streams_fail_with_their_reason(name, reason):
    r = sv.parse_stream(timed(SCRIPTS[name]))
    assert not r.ok and reason in r.error
    assert r.ttft_s is None and r.tpot_s is None


def test_http_error_status_fails():
    r = sv.parse_stream([(0.01, '{"error": "busy"}')], status=503)
    assert not r.ok and r.error.startswith("HTTP 503")


def test_completions_stream_text_counts_as_output():
    chunk = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
    end = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    r = sv.parse_stream(timed([data(chunk), data(end), data(usage), b"data: [DONE]\n\n"]))
    assert r.ok and r.ttft_s == pytest.approx(0.01) and r.tpot_s is None  # one token: no TPOT


# ---------------------------------------------------------------- statistics, schedules, goodput (pure)

def test_percentile_interpolates_like_numpy_linear():
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert sv.percentile(xs, 0) == 15.0 and sv.percentile(xs, 100) == 50.0
    assert sv.percentile(xs, 50) == 35.0
    assert sv.percentile(xs, 40) == pytest.approx(29.0)  # pos 1.6: 20 + 0.6 * 15
    assert sv.percentile(xs, 90) == pytest.approx(46.0)  # pos 3.6: 40 + 0.6 * 10
    assert sv.percentile([3.0, 1.0, 2.0], 50) == 2.0  # input order does not matter
    assert sv.percentile(list(map(float, range(1, 101))), 99) == pytest.approx(99.01)
    with pytest.raises(ValueError):
        sv.percentile([], 50)


def test_describe_reports_milliseconds():
    d = sv.describe([0.001, 0.002, 0.003, 0.004])
    assert d["mean"] == pytest.approx(2.5) and d["median"] == pytest.approx(2.5)
    assert d["p99"] == pytest.approx(3.97)
    assert sv.describe([]) == {s: None for s in sv.STATS}


def test_poisson_schedule_is_deterministic_and_has_the_rate():
    a = sv.poisson_arrivals(4.0, 2000, seed=3)
    assert a == sv.poisson_arrivals(4.0, 2000, seed=3)
    assert a != sv.poisson_arrivals(4.0, 2000, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)


def test_goodput_counts_completed_requests_within_every_slo():
    fast = sv.RequestResult(True, completion_tokens=5, ttft_s=0.1, e2el_s=0.5)  # tpot 100 ms
    slow_ttft = sv.RequestResult(True, completion_tokens=5, ttft_s=0.9, e2el_s=1.3)
    slow_tpot = sv.RequestResult(True, completion_tokens=5, ttft_s=0.1, e2el_s=2.1)  # tpot 500 ms
    failed = sv.RequestResult(False, "the stream ended without [DONE]")
    slos = sv.parse_goodput(["ttft:500 tpot:200"])
    assert slos == (("ttft", 500.0), ("tpot", 200.0))
    s = sv.summarize("concurrency", 2, [fast, slow_ttft, slow_tpot, failed], 2.0, slos)
    assert s.completed == 3 and s.failed == 1 and s.goodput == pytest.approx(0.5)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.failures == {"the stream ended without [DONE]": 1}
    assert sv.summarize("concurrency", 2, [fast], 1.0).goodput is None


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:x", "ttft:-1"])
def test_bad_goodput_specs_are_refused(bad):
    with pytest.raises(sv.ServeBenchError):
        sv.parse_goodput([bad])


def test_prompts_differ_per_request_and_repeat_per_seed():
    assert sv.prompt_text(0, 10, 0) != sv.prompt_text(1, 10, 0)
    assert sv.prompt_text(5, 10, 0) == sv.prompt_text(5, 10, 0)


# ---------------------------------------------------------------- against the scripted server

def test_closed_loop_counts_broken_streams_as_failures():
    plan = ["good", "no_done", "good", "broken_json", "good", "error_event", "good", "no_usage"]
    with ScriptedServer(plan, gap=0.002) as srv:
        cfg = sv.ServeBenchConfig(url=srv.url, concurrency=(1, 4), requests=8, warmup=0, max_tokens=3)
        result = run(cfg)
        assert srv.count == 16
        first = srv.bodies[0]
    assert first["model"] == "scripted-model" and first["stream"] is True
    assert first["stream_options"] == {"include_usage": True} and first["max_tokens"] == 3
    for lv in result.levels:
        assert (lv.completed, lv.failed) == (4, 4)
        assert sum(lv.failures.values()) == 4
        assert lv.stats["ttft"]["median"] is not None and lv.stats["ttft"]["median"] > 0
        assert lv.output_token_throughput == pytest.approx(lv.request_throughput * 3)
    assert [lv.level for lv in result.levels] == [1.0, 4.0]


def test_concurrency_overlaps_requests():
    with ScriptedServer(["good"], gap=0.03) as srv:
        result = run(sv.ServeBenchConfig(url=srv.url, concurrency=(1, 4), requests=4, warmup=0))
    one, four = result.levels
    assert one.completed == four.completed == 4
    assert one.duration_s > 2.5 * four.duration_s  # 4 sequential streams versus 4 at once


def test_open_loop_follows_the_poisson_schedule():
    with ScriptedServer(["good"]) as srv:
        result = run(sv.ServeBenchConfig(url=srv.url, concurrency=(), rates=(20.0,), requests=6, warmup=0, seed=5))
    lv = result.levels[0]
    assert lv.mode == "rate" and lv.completed == 6
    assert lv.duration_s >= sv.poisson_arrivals(20.0, 6, 5)[-1]


def test_refused_connection_and_http_errors_are_failures():
    with ScriptedServer(["good"], status=503) as srv:
        result = run(sv.ServeBenchConfig(url=srv.url, requests=3, warmup=0, model="m"))
    assert result.levels[0].failed == 3 and list(result.levels[0].failures)[0].startswith("HTTP 503")
    with pytest.raises(sv.ServeBenchError, match="cannot reach"):
        run(sv.ServeBenchConfig(url="http://127.0.0.1:9", requests=1, warmup=0))


def test_cli_writes_csv_json_and_plot(tmp_path):
    plan = ["good", "good", "no_finish"]
    with ScriptedServer(plan) as srv:
        r = CliRunner().invoke(cli.main, [
            "serve", "--no-probe", "--url", srv.url + "/v1", "--concurrency", "1,2", "--requests", "6", "--warmup", "0",
            "--goodput", "ttft:10000 tpot:10000", "--csv", str(tmp_path / "s.csv"), "--json", str(tmp_path / "s.json"),
            "--plot", str(tmp_path / "s.svg")])
    assert r.exit_code == 0, r.output
    assert "C=2 / C=1 request throughput" in r.output and "no finish_reason" in r.output
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [(x["mode"], x["level"], x["completed"], x["failed"]) for x in rows] == [
        ("concurrency", "1", "4", "2"), ("concurrency", "2", "4", "2")]
    assert float(rows[0]["goodput"]) == pytest.approx(float(rows[0]["request_throughput"]))
    doc = json.load(open(tmp_path / "s.json"))
    assert doc["model"] == "scripted-model" and len(doc["levels"]) == 2 and "api_key" not in doc["config"]
    assert (tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")


def test_cli_rate_only_runs_no_closed_loop(tmp_path):
    with ScriptedServer(["good"]) as srv:
        r = CliRunner().invoke(cli.main, ["serve", "--no-probe", "--url", srv.url, "--rate", "50", "--requests", "3", "--warmup", "1",
                                          "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png")])
        assert srv.count == 4  # the warm-up and the three timed requests
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [(x["mode"], x["level"], x["completed"]) for x in rows] == [("rate", "50", "3")]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,needle", [
    (["--url", "localhost:8000"], "--url must be an http(s) URL"),
    (["--url", "http://x", "--concurrency", "0"], "at least 1"),
    (["--url", "http://x", "--rate", "fast"], "comma-separated numbers"),
    (["--url", "http://x", "--goodput", "p99:3"], "--goodput wants"),
    (["--url", "http://x", "--plot", "out.pdf"], ".png or .svg"),
])
def test_cli_bad_input_is_one_line(args, needle):
    r = CliRunner().invoke(cli.main, ["serve", *args])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-bench: error: ") and needle in lines[0], r.output
