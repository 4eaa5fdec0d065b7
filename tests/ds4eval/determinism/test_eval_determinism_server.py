"""`ds4-eval determinism --backend openai` against the real ds4-server (uvicorn on a loopback
port, batched sessions, the embedded model: marked `model`): one completion per prompt under
every condition, streaming and n=2 included; the result file and the report page are written."""

import pytest
from determinism_server import ds4_eval, serving

from ds4eval.determinism.analysis import read_result

pytestmark = pytest.mark.model

SMALL_RUN = ("--prompts", 2, "--repeats", 2, "--concurrency", 2, "--mixed-rounds", 1, "--max-tokens", 8)


@pytest.fixture(scope="module")
def server_url(embedded_path):
    from engine import load_model

    with serving(load_model(embedded_path), batched_session=4) as url:
        yield url


def test_ds4_server_is_invariant_under_every_condition(server_url, tmp_path):
    out, page = tmp_path / "det.json", tmp_path / "det.html"
    r = ds4_eval("determinism", "--backend", "openai", "--url", server_url, *SMALL_RUN, "--expect", "invariant",
                 "-o", out, "--report", page)
    assert r.exit_code == 0, r.output
    assert "INVARIANT: one completion per prompt under every condition (6 conditions)" in r.stdout
    result = read_result(out.read_text(encoding="utf-8"))
    assert result.invariant
    assert [(v.condition, v.verdict, v.prompts) for v in result.verdicts] == [
        ("alone", "invariant", 2), ("mixed C=2", "invariant", 2), ("prefix", "invariant", 2),
        ("stream", "invariant", 2), ("n=2", "invariant", 2), ("max_tokens", "invariant", 2)]
    # Log-probabilities came back: completions were compared token by token.
    assert {o.unit for o in result.outcomes} == {"token"} and result.notes == ()
    assert result.stack["backend"] == "openai" and result.stack["url"] == server_url
    assert result.stack["served_model"]  # named by GET /v1/models
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "INVARIANT" in html and "mixed C=2" in html


def test_output_into_a_missing_directory_is_refused_before_any_request(server_url, tmp_path):
    missing = tmp_path / "no such dir" / "det.json"
    page = tmp_path / "det.html"
    r = ds4_eval("determinism", "--backend", "openai", "--url", server_url, "--prompts", 1, "--repeats", 1,
                 "--condition", "alone", "--max-tokens", 2, "-o", missing, "--report", page)
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [f"ds4-eval: error: cannot write the result {missing}: "
                                     f"no directory {missing.parent}"]
    assert "Traceback" not in r.output and r.stdout == ""  # refused before it measured anything
    assert list(tmp_path.iterdir()) == []  # no directory made, no temporary file left, no report
