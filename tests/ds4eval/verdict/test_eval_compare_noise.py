"""`ds4-eval compare --noise FILE`: how many flips the stack's own variation explains."""

import json

from click.testing import CliRunner

from ds4eval import cli
from ds4eval.determinism.analysis import Divergence, Outcome, Result
from tests.ds4eval.verdict.test_eval_compare import pair, rec


def noise_file(tmp_path, varying, steady, condition="mixed C=4"):
    """A determinism result over cases named toy/cN: `varying` parted under `condition`."""
    outcomes = [Outcome(f"toy/c{i}", condition, 3, 2, "token", Divergence(5, " 4", " 5", "mixed", 0.01, "near-tie"))
                for i in varying]
    outcomes += [Outcome(f"toy/c{i}", condition, 3, 1, "token", None) for i in steady]
    path = tmp_path / "noise.json"
    path.write_text(Result({"backend": "openai", "url": "http://127.0.0.1:1"}, {"prompts": len(outcomes)},
                           tuple(outcomes)).to_json(), encoding="utf-8")
    return path


def compare(*args):
    return CliRunner().invoke(cli.main, ["compare", *map(str, args)])


def flipped_pair(tmp_path):
    base = [rec(i) for i in range(1, 11)]
    new = [rec(i, "FAILED", "5") for i in (1, 2, 3)] + base[3:]  # c1, c2, c3 flip to a failure
    return pair(tmp_path, base, new)


def test_flips_on_cases_that_vary_by_themselves_are_explained_case_by_case(tmp_path):
    b, n = flipped_pair(tmp_path)
    noise = noise_file(tmp_path, varying=(1, 7), steady=(2, 3, 4, 5, 6, 8, 9, 10))
    r = compare(b, n, "--noise", noise, "--format", "json")
    data = json.loads(r.output)["noise"]
    assert (data["method"], data["flips"], data["explained"], data["unexplained"], data["measured"]) == \
        ("by case", 3, 1, 2, 3)
    assert data["conditions"] == {"mixed C=4": "varies"} and data["invariant"] is False
    text = compare(b, n, "--noise", noise).output
    assert "Stack noise" in text and "1 of 3 flipped cases are cases whose output varies" in text
    assert text.index("Stack noise") < text.index("Verdict")  # the verdict stays last on a terminal


def test_a_noise_run_over_other_prompts_explains_by_rate(tmp_path):
    b, n = flipped_pair(tmp_path)
    outcomes = tuple(Outcome(f"p{i:02d}", "alone", 5, 2 if i < 5 else 1, "token", None) for i in range(20))
    path = tmp_path / "own.json"
    path.write_text(Result({"backend": "engine", "model": "m.gguf"}, {}, outcomes).to_json(), encoding="utf-8")
    data = json.loads(compare(b, n, "--noise", path, "--format", "json").output)["noise"]
    # 5 of 20 prompts varied: 2.5 of the 10 compared cases expected, a 95% bound of 5, both capped at
    # the 3 flips.
    assert (data["method"], data["varying_share"], data["explained"], data["upper"]) == ("by rate", 0.25, 3, 3)
    assert data["compared"] == 10


def test_an_invariant_stack_explains_no_flip_and_the_page_has_the_section(tmp_path):
    b, n = flipped_pair(tmp_path)
    noise = noise_file(tmp_path, varying=(), steady=range(1, 11), condition="alone")
    page = tmp_path / "cmp.html"
    r = compare(b, n, "--noise", noise, "--report", page)
    assert "none of the 3 flips comes from its own non-determinism" in r.output
    assert "Stack noise" in page.read_text(encoding="utf-8")


def test_a_noise_file_that_is_not_a_determinism_result_is_one_line_and_exit_two(tmp_path):
    b, n = flipped_pair(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "ds4eval-comparison"}), encoding="utf-8")
    r = compare(b, n, "--noise", bad)
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and "not a ds4-eval determinism result" in r.output
    r = compare(b, n, "--noise", tmp_path / "missing.json")
    assert r.exit_code == 2 and "missing.json" in r.output
