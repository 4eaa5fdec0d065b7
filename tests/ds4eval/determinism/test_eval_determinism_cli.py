"""`ds4-eval determinism`'s input errors: each is one line on stderr and exit status 2, before
any model is loaded or request sent (no weights, no server)."""

import pytest
from determinism_server import ds4_eval, free_port

from ds4eval.cli.determinism_commands import exit_status
from ds4eval.determinism.analysis import Divergence, Outcome, Result


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-eval: error: "), r.stderr
    return lines[0].removeprefix("ds4-eval: error: ")


def test_help_lists_determinism():
    r = ds4_eval("--help")
    assert r.exit_code == 0
    listed = r.output.split("Commands:\n", 1)[1]
    assert any(line.split()[:1] == ["determinism"] for line in listed.splitlines())
    r = ds4_eval("determinism", "--help")
    assert r.exit_code == 0 and "--expect" in r.output and "--concurrency" in r.output


def test_openai_backend_needs_a_url():
    assert one_error_line(ds4_eval("determinism", "--backend", "openai")) == "--backend openai needs --url"


def test_an_unreachable_endpoint_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    message = one_error_line(ds4_eval("determinism", "--backend", "openai", "--url", url, "--prompts", 1))
    assert message.startswith(f"cannot reach the server at {url}: ")


def test_more_prompts_than_the_own_set_needs_a_suite():
    message = one_error_line(ds4_eval("determinism", "--prompts", 99))
    assert message == "--prompts 99: the project's own set has 24 prompts (use --suite for more)"


@pytest.mark.parametrize("args, message", [
    (("--url", "http://127.0.0.1:9"), "--url is for --backend openai"),
    (("--prompts", 0), "--prompts must be at least 1"),
    (("--concurrency", 0), "--concurrency must be at least 1"),
    (("--margin", -1), "--margin must be at least 0"),
])
def test_other_bad_settings_are_one_line(args, message):
    assert one_error_line(ds4_eval("determinism", *args)) == message


def verdict_result(distinct: int = 1, errors=()) -> Result:
    div = None if distinct == 1 else Divergence(1, "a", "b", "x", 1.0, "real")
    return Result({}, {}, (Outcome("p01", "alone", 2, 1, "token", None),
                           Outcome("p01", "mixed C=1", 2, distinct, "token", div, tuple(errors))))


def test_exit_status_measured_not_invariant_and_incomplete():
    assert exit_status(verdict_result(), None) == 0
    assert exit_status(verdict_result(), "invariant") == 0
    assert exit_status(verdict_result(2), None) == 0  # measured: varying is a finding, not a failure
    assert exit_status(verdict_result(2), "invariant") == 1
    assert exit_status(verdict_result(errors=("mixed C=1 round 0: HTTP 500",)), None) == 3
    assert exit_status(verdict_result(2, ("mixed C=1 round 0: HTTP 500",)), "invariant") == 3
