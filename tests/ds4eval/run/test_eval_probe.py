"""The capability probe against a fake server whose features work, are ignored or are refused:
the verdicts, what stops a run and what is only a note, `ds4-eval --probe`, and the probes
before `ds4-eval --backend openai`, `ds4-bench serve` and `ds4-bench kld --stack openai`."""

from capability_fakes import FakeCapabilities
from click.testing import CliRunner

from ds4bench import cli as bench_cli
from ds4eval import cli
from ds4eval.run import capabilities as cap
from ds4eval.run import probe as endpoint_probe

ALL = list(cap.FEATURES)


def verdicts(srv, features=ALL, **kw):
    result = endpoint_probe.run_probe(srv.url, features, **kw)
    return {f.feature: f.verdict for f in result.findings}, result


def test_every_feature_supported():
    with FakeCapabilities() as srv:
        got, result = verdicts(srv)
    assert got == dict.fromkeys(ALL, cap.SUPPORTED), result.findings
    assert result.model == "cap-model" and all(b.get("model") == "cap-model" for b in srv.bodies)
    # Cheap: a few requests of a few tokens each.
    assert len(srv.bodies) <= 12 and all(b["max_tokens"] <= 16 for b in srv.bodies)


def test_every_feature_ignored():
    with FakeCapabilities(modes=dict.fromkeys(ALL, "ignore")) as srv:
        got, result = verdicts(srv)
    assert got == dict.fromkeys(ALL, cap.IGNORED), result.findings
    detail = {f.feature: f.detail for f in result.findings}
    assert detail["n"] == "asked for 2 choices, got 1" and "does not start with the prompt" in detail["echo"]
    assert "seed 1234 gave different text" in detail["seed"] and detail["ignore_eos"] == "the reply stopped early: finish_reason stop"


def test_every_feature_rejected():
    with FakeCapabilities(modes=dict.fromkeys(ALL, "reject")) as srv:
        got, result = verdicts(srv, [f for f in ALL if f != "token counts"])
    assert set(got.values()) == {cap.REJECTED}, result.findings
    assert {f.feature: f.detail for f in result.findings}["echo"] == \
        "HTTP 400: echo together with logprobs is not supported"


def test_inconsistent_counts_fail_and_a_constant_reply_leaves_the_seed_unverifiable():
    with FakeCapabilities(modes={"token counts": "broken", "seed": "constant"}) as srv:
        got, result = verdicts(srv, ["token counts", "seed"])
    assert got == {"token counts": cap.FAILED, "seed": cap.UNVERIFIABLE}
    assert "total_tokens 15 is not prompt_tokens 9 + completion_tokens 1" in result.findings[0].detail


def test_the_probe_keeps_within_its_time_bound():
    with FakeCapabilities(delay_s=0.4) as srv:
        got, result = verdicts(srv, ["streaming usage", "seed", "n"], budget_s=1.0)
    assert result.seconds < 2.0
    assert got["n"] == cap.UNVERIFIABLE and "ran out" in result.findings[-1].detail


def test_a_server_that_streams_every_answer_is_judged_the_same():
    chunks = ({"choices": [{"index": 0, "delta": {"content": "yes"}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})
    reply = cap.Reply(200, chunks=chunks, streamed=True, done=True)
    assert cap.FEATURES["token counts"].judge([reply]).verdict == cap.SUPPORTED
    assert cap.choices(reply)[0].text == "yes" and cap.usage(reply)["completion_tokens"] == 3
    assert cap.FEATURES["streaming usage"].judge([cap.Reply(200, chunks=chunks[:2], streamed=True, done=True)]) \
        .verdict == cap.IGNORED


def test_check_stops_on_a_required_feature_and_notes_the_rest():
    findings = [cap.Finding("seed", cap.IGNORED, "differs"), cap.Finding("n", cap.REJECTED, "HTTP 400"),
                cap.Finding("streaming usage", cap.SUPPORTED, ""), cap.Finding("echo", cap.UNVERIFIABLE, "?")]
    stop, notes = cap.check([cap.Need("seed", True, "for --seed"), cap.Need("n", False, "for --repeats"),
                             cap.Need("streaming usage", True, "x"), cap.Need("echo", True, "for kld")], findings)
    assert stop == "seed is ignored (differs); needed for --seed"
    assert notes == ["n is rejected (HTTP 400); used for --repeats", "echo is unverifiable (?); needed for kld"]


def test_api_root_accepts_v1_and_endpoint_urls():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert cap.api_root(url) == "http://h:1"


# ---------------------------------------------------------------- the commands

def test_probe_flag_prints_the_table():
    with FakeCapabilities(modes={"echo": "reject", "n": "ignore"}) as srv:
        r = CliRunner().invoke(cli.main, ["--probe", "--url", srv.url + "/v1", "--api-model", "mine"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith(f"{srv.url}, model mine: {len(ALL)} features probed in")
    rows = {line.split("  ")[0]: line for line in lines[3:]}
    assert "rejected" in rows["echo"] and "ignored" in rows["n"] and "supported" in rows["seed"]
    assert all(b["model"] == "mine" for b in srv.bodies)


def test_probe_flag_unreachable_is_one_line_exit_1():
    r = CliRunner().invoke(cli.main, ["--probe", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 1 and r.output.strip() == \
        "ds4-eval: error: cannot reach the server at http://127.0.0.1:9: connection refused"


RUN = ["--plain", "--backend", "openai", "--case-id", "int-add-small", "--tokens", "8"]


def test_a_run_that_needs_an_ignored_seed_stops_before_the_first_case(tmp_path):
    with FakeCapabilities(modes={"seed": "ignore"}) as srv:
        r = CliRunner().invoke(cli.main, [*RUN, "--url", srv.url, "--temp", "0.7", "--seed", "1"])
        assert r.exit_code == 3, r.output
        assert "ds4-eval: error: the server at" in r.output and "seed is ignored" in r.output
        assert "--no-probe skips this check" in r.output and "PASSED" not in r.output
        asked = len(srv.bodies)
        ok = CliRunner().invoke(cli.main, [*RUN, "--url", srv.url, "--temp", "0.7", "--seed", "1", "--no-probe"])
        assert ok.exit_code == 0, ok.output
        assert len(srv.bodies) == asked + 1  # the case alone


def test_a_missing_optional_feature_is_a_note_and_the_run_goes_on():
    with FakeCapabilities(modes={"n": "reject"}) as srv:
        r = CliRunner().invoke(cli.main, [*RUN, "--url", srv.url, "--repeats", "2"])
    assert r.exit_code == 0, r.output
    assert "ds4-eval: note: n is rejected (HTTP 400: n is not supported)" in r.output
    # The greedy run sends no seed, so the probe asked only for streaming usage and n.
    assert not any("seed" in b for b in srv.bodies[:3])


def test_bench_serve_stops_without_streaming_usage_and_notes_ignore_eos():
    with FakeCapabilities(modes={"streaming usage": "ignore"}) as srv:
        r = CliRunner().invoke(bench_cli.main, ["serve", "--url", srv.url, "--requests", "1", "--warmup", "0"])
        assert r.exit_code == 1 and "streaming usage is ignored" in r.output and len(srv.bodies) == 3
    with FakeCapabilities(modes={"ignore_eos": "ignore"}) as srv:
        r = CliRunner().invoke(bench_cli.main, ["serve", "--url", srv.url, "--requests", "1", "--warmup", "0"])
        assert r.exit_code == 0, r.output
        assert "note: ignore_eos is ignored" in r.output


def test_bench_kld_openai_stops_when_echo_is_rejected(tmp_path):
    with FakeCapabilities(modes={"echo": "reject"}) as srv:
        r = CliRunner().invoke(bench_cli.main, ["kld", "--save-base", str(tmp_path / "base.npz"), "--stack", "openai",
                                                "--url", srv.url])
    assert r.exit_code == 2, r.output
    assert "echo is rejected (HTTP 400: echo together with logprobs is not supported)" in r.output


# ---------------------------------------------------------------- several endpoints (pure)

def test_differences_compare_only_what_each_endpoint_shows():
    A, B, C = "http://a", "http://b", "http://c"
    same = [endpoint_probe.EndpointCheck(A, models=("m",), template_sha256="t" * 64),
            endpoint_probe.EndpointCheck(B, models=(), template_sha256=""),  # no model list, no template shown
            endpoint_probe.EndpointCheck(C, models=("m",))]
    assert endpoint_probe.differences(same) == []
    seed = lambda v: (cap.Finding("seed", v, ""),)  # noqa: E731
    mixed = [endpoint_probe.EndpointCheck(A, models=("m",), findings=seed(cap.SUPPORTED)),
             endpoint_probe.EndpointCheck(B, models=("m",), findings=seed(cap.IGNORED))]
    assert endpoint_probe.differences(mixed) == [f"capability 'seed' differs: {A} supported; {B} ignored"]


def test_settle_leaves_out_what_does_not_answer_and_keeps_one_endpoint_s_own_lines():
    live = endpoint_probe.EndpointCheck("http://a", models=("m",), notes=("n is rejected",))
    dead = endpoint_probe.EndpointCheck("http://b", error="cannot reach the server at http://b: connection refused")
    got = endpoint_probe.settle([live, dead], allow_mixed=False)
    assert got.usable == (live,) and got.error == ()
    assert got.notes == ("cannot reach the server at http://b: connection refused: left out of the run",
                         "n is rejected")
    assert endpoint_probe.settle([dead], allow_mixed=False).error == (dead.error,)
    lacking = endpoint_probe.EndpointCheck("http://a", models=("m",), stop="the server at http://a lacks seed")
    assert endpoint_probe.settle([lacking], allow_mixed=True).error == ("the server at http://a lacks seed",)
