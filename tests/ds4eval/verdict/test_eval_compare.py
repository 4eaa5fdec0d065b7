"""`ds4-eval --compare` on hand-made traces and summaries: every warning path, every exit status,
old-format traces, texts with block-marker-like lines, the render diff and the three formats."""

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.run import trace as tr
from ds4eval.run.provenance import RenderedPrompt, split_tokens
from ds4eval.verdict import compare as cmp

REPO = Path(__file__).resolve().parents[3]
PIECES = ["<|im_start|>", "system", "\n", "Be", " brief", ".", "<|im_end|>", "\n", "<|im_start|>", "user", "\n"]


def rendered(pieces):
    """The trace fields of a rendered prompt made of these token texts."""
    p = RenderedPrompt.of([0], pieces)
    return {"rendered_prompt": p.text, "rendered_token_ends": p.ends_field}


def tokens(r):
    return split_tokens(r.rendered_prompt, r.rendered_token_ends)


def rec(i, status="PASSED", picked="4", *, source="toy", expected="4", **kw):
    """A trace record with full provenance; `kw` overrides any field."""
    fields = dict(
        index=i, source=source, id=f"c{i}", status=status, picked=picked, expected=expected,
        answer_kind="integer", domain="math", suite="toy", model="Toy 1B", backend="engine", prompt_tokens=20,
        gen_tokens=10 + i, elapsed_s=0.5, temperature=0.0, case_hash=f"sha256:{i:064x}", max_tokens=128,
        prompt_sha256=f"{i:064x}", model_sha256="ab" * 32, chat_template_sha256="cd" * 32,
        bos_eos="add_bos=no bos=1 eos=2", device="cpu", kv_type="float16", extractor_version="e1",
        ds4eval_version="0.1.0", git_commit="f" * 40, **rendered(PIECES + [f"What is {i}?"]),
        system_prompt="Be brief.", question_prompt=f"What is {i}?",
        model_output=f"Answer: {picked}" if picked else "I do not know")
    fields.update(kw)
    return tr.TraceRecord(**fields)


def write(path: Path, records) -> str:
    path.write_text("".join(map(tr.format_record, records)), encoding="utf-8", newline="")
    return str(path)


def invoke(*args):
    return CliRunner().invoke(cli.main, ["--compare", *map(str, args)])


def as_json(*args):
    r = invoke(*args, "--format", "json")
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


def pair(tmp_path, base, new):
    return write(tmp_path / "base.trace", base), write(tmp_path / "new.trace", new)


def test_identical_runs_exit_zero_with_no_flips(tmp_path):
    recs = [rec(i, "PASSED" if i % 2 else "FAILED", "4" if i % 2 else "5") for i in range(1, 11)]
    code, out = as_json(*pair(tmp_path, recs, recs))
    assert code == 0 and out["flips"] == [] and out["warnings"] == [] and out["differences"] == []
    t = out["total"]
    assert (t["cases"], t["base_passed"], t["new_passed"], t["delta"]) == (10, 5, 5, 0.0)
    assert t["mcnemar"] == {"pass_fail": 0, "fail_pass": 0, "p_exact": 1.0, "mid_p": 1.0}
    assert t["interval"]["low"] == t["interval"]["high"] == 0.0 and t["interval"]["resamples"] >= 10_000


def test_significant_regression_exits_one_and_lists_every_flip(tmp_path):
    base = [rec(i) for i in range(1, 13)]
    # Eight cases flip to a failure, two of them because no answer was found at all.
    new = [rec(i, "FAILED", "5") for i in range(1, 7)] + [rec(i, "FAILED", None) for i in (7, 8)] + base[8:]
    code, out = as_json(*pair(tmp_path, base, new))
    assert code == 1 and out["regression"] is True
    assert out["total"]["mcnemar"]["pass_fail"] == 8 and out["total"]["mcnemar"]["p_exact"] == pytest.approx(2 / 256)
    assert out["total"]["pass_fail_no_answer"] == 2 and out["total"]["new_no_answer"] == 2
    flips = {(f["id"], f["direction"], f["new_picked"], f["no_answer"]) for f in out["flips"]}
    assert flips == {(f"c{i}", "pass->fail", "5", False) for i in range(1, 7)} | \
        {(f"c{i}", "pass->fail", None, True) for i in (7, 8)}
    assert out["total"]["interval"]["high"] < 0 < 1  # the whole interval lies below zero
    text = invoke(tmp_path / "base.trace", tmp_path / "new.trace").output
    assert "significant regression" in text and "2 no answer found" in text and "toy/c7" in text


def test_one_flip_passes_unless_strict(tmp_path):
    base = [rec(i) for i in range(1, 6)]
    new = [rec(1, "FAILED", "7")] + base[1:]
    b, n = pair(tmp_path, base, new)
    r = invoke(b, n)
    assert r.exit_code == 0 and "no significant regression" in r.output
    r = invoke(b, n, "--strict")
    assert r.exit_code == 1 and "regression under --strict: 1 pass→fail" in r.output
    # A gain is never a regression, strict or not.
    r = invoke(n, b, "--strict")
    assert r.exit_code == 0


def test_alpha_sets_the_significance_level(tmp_path):
    base = [rec(i) for i in range(1, 8)]
    new = [rec(i, "FAILED", "9") for i in range(1, 6)] + base[5:]  # 5 against 0: p = 2/32
    b, n = pair(tmp_path, base, new)
    assert invoke(b, n).exit_code == 0
    assert invoke(b, n, "--alpha", "0.1").exit_code == 1
    assert invoke(b, n, "--alpha", "0").exit_code == 2


def test_strict_counts_a_lost_pass(tmp_path):
    base = [rec(i) for i in range(1, 5)]
    new = [rec(1, "ERROR", None, error="boom")] + base[1:3]  # c1 errored, c4 is missing
    code, out = as_json(*pair(tmp_path, base, new))
    assert code == 0 and out["lost_passes"] == ["toy/c1", "toy/c4"]
    kinds = {w["kind"] for w in out["warnings"]}
    assert {"ungraded", "only_base"} <= kinds
    assert invoke(tmp_path / "base.trace", tmp_path / "new.trace", "--strict").exit_code == 1


@pytest.mark.parametrize("change, kind, allowable", [
    (dict(case_hash="sha256:" + "9" * 64), "pin", False),
    (dict(model_sha256="ef" * 32), "model", True),
    (dict(prompt_sha256="77" * 32), "prompt", True),
    (dict(temperature=0.7, top_p=0.9), "sampling", True),
    (dict(status="STOPPED"), "ungraded", False),
])
def test_each_exclusion_warns_and_leaves_the_verdict(tmp_path, change, kind, allowable):
    base = [rec(i) for i in range(1, 7)]
    new = [dataclasses.replace(base[0], **change)] + [rec(i, "FAILED", "3") for i in (2, 3)] + base[3:]
    b, n = pair(tmp_path, base, new)
    code, out = as_json(b, n)
    warning = next(w for w in out["warnings"] if w["kind"] == kind)
    assert warning["cases"] == ["toy/c1"] and warning["excluded"] is True
    assert out["total"]["cases"] == 5
    assert next(c for c in out["cases"] if c["id"] == "c1")["excluded"] == kind
    if allowable:
        assert f"--allow-diff {kind}" in warning["message"]
        code, out = as_json(b, n, "--allow-diff", kind)
        assert out["total"]["cases"] == 6
        assert next(w for w in out["warnings"] if w["kind"] == kind)["excluded"] is False


def test_cases_on_one_side_only_and_repeated_records(tmp_path):
    base = [rec(i) for i in range(1, 5)]
    new = [rec(2), rec(3), rec(4), rec(5), rec(4, "FAILED", "1"), rec(4)]  # c4 retried twice; the last counts
    code, out = as_json(*pair(tmp_path, base, new))
    msgs = {w["kind"]: w for w in out["warnings"]}
    assert msgs["only_base"]["cases"] == ["toy/c1"] and msgs["only_new"]["cases"] == ["toy/c5"]
    assert "2 case record(s) superseded" in msgs["repeated"]["message"] and msgs["repeated"]["excluded"] is False
    assert code == 0 and out["flips"] == [] and out["total"]["cases"] == 3


def test_greedy_runs_ignore_top_p_and_seed_but_note_other_settings(tmp_path):
    base = [rec(i) for i in range(1, 4)]
    new = [dataclasses.replace(r, top_p=0.5, seed=7, kv_type="float32", max_tokens=32) for r in base]
    code, out = as_json(*pair(tmp_path, base, new))
    assert code == 0 and out["warnings"] == [] and out["total"]["cases"] == 3
    assert {(d["field"], d["base"], d["new"], d["cases"]) for d in out["differences"]} == \
        {("kv_type", "float16", "float32", 3), ("max_tokens", "128", "32", 3)}


def test_render_diff_shows_a_bos_change_at_a_glance(tmp_path):
    base = [rec(i) for i in range(1, 4)]
    new = [dataclasses.replace(r, prompt_sha256="0" * 64, **rendered(["<s>"] + tokens(r)),
                               bos_eos="add_bos=yes bos=1 eos=2") for r in base]
    b, n = pair(tmp_path, base, new)
    code, out = as_json(b, n, "--allow-diff", "prompt")
    (d,) = out["render_diffs"]  # one template or BOS change: one entry for all three cases
    assert d["cases"] == ["toy/c1", "toy/c2", "toy/c3"] and d["position"] == 0
    assert d["base_context"][0] == "<|im_start|>" and d["new_context"][:2] == ["<s>", "<|im_start|>"]
    assert ("bos_eos", "add_bos=no bos=1 eos=2", "add_bos=yes bos=1 eos=2", 3) in \
        {(x["field"], x["base"], x["new"], x["cases"]) for x in out["differences"]}
    text = invoke(b, n, "--allow-diff", "prompt").output
    assert "first difference at token 0" in text and "BASE ⟦<|im_start|>⟧|system|\\n" in text
    assert "NEW  ⟦<s>⟧|<|im_start|>|system" in text


def test_render_diff_of_a_template_change_mid_prompt(tmp_path):
    base = [rec(1)]
    pieces = tokens(base[0])
    pieces[2] = "\n\n"
    new = [dataclasses.replace(base[0], prompt_sha256="1" * 64, **rendered(pieces))]
    out = cmp.compare(*(cmp.read_run(Path(p).read_text(), p) for p in pair(tmp_path, base, new)),
                      allow=("prompt",))
    (d,) = out.render_diffs
    assert d.position == 2 and d.context_start == 0 and d.base_context[2] == "\n" and d.new_context[2] == "\n\n"
    # Without token texts (a backend that does not tokenize) the prompt texts show where.
    no_pieces = [dataclasses.replace(r, prompt_sha256="", **rendered([])) for r in base]
    other = [dataclasses.replace(no_pieces[0], question_prompt="What is 1 ?")]
    out = cmp.compare(*(cmp.read_run(Path(p).read_text(), p) for p in pair(tmp_path, no_pieces, other)),
                      allow=("prompt",))
    (d,) = out.render_diffs
    assert d.position is None and "first differ at character 19" in d.note


def test_unusable_input_is_one_line_and_exit_two(tmp_path):
    good = write(tmp_path / "good.trace", [rec(1)])
    junk = tmp_path / "junk.trace"
    junk.write_text("hello\nworld\n")
    other = write(tmp_path / "other.trace", [rec(1, source="elsewhere")])
    other_model = write(tmp_path / "model.trace", [rec(1, model_sha256="00" * 32)])
    empty_summary = tmp_path / "s.json"
    empty_summary.write_text(json.dumps({"format": "ds4eval-summary", "version": 1, "cases": []}))
    for args, msg in [((good, tmp_path / "missing.trace"), "cannot read"),
                      ((good, junk), "not a ds4-eval trace"),
                      ((good, other), "no case in common"),
                      ((good, other_model), "none of the 1 matched cases is comparable (1 model); --allow-diff"),
                      ((good, empty_summary), "holds no per-case verdicts")]:
        r = invoke(*args)
        assert r.exit_code == 2 and msg in r.output, r.output
        assert r.output.count("\n") == 1 and r.output.startswith("ds4-eval: error: ") and "Traceback" not in r.output


def test_old_format_traces_load_and_compare(tmp_path):
    """The committed example predates provenance and content hashes; one case's output is edited
    in a copy, and a status-less copy (a trace from before statuses) is graded from its outputs."""
    old = REPO / "traces" / "sanity-smollm2-greedy.trace"
    records = tr.read_trace(old).records
    assert records and not any(r.case_hash or r.model_sha256 or r.rendered_prompt for r in records)
    edited = [dataclasses.replace(r, status="FAILED", picked="C", model_output="Answer: C")
              if r.id == "choice-sky-colour" else r for r in records]
    new = write(tmp_path / "edited.trace", edited)
    code, out = as_json(old, new)
    assert code == 0 and out["total"]["cases"] == 41 and out["total"]["base_passed"] == 13
    assert [(f["id"], f["direction"]) for f in out["flips"]] == [("choice-sky-colour", "pass->fail")]
    assert {w["kind"] for w in out["warnings"]} == {"provenance"}
    statusless = write(tmp_path / "nostatus.trace", [dataclasses.replace(r, status=None, picked=None) for r in records])
    code, out = as_json(old, statusless)
    assert out["total"]["new_passed"] == 13 and out["flips"] == []
    # An old trace against a new one: the answer keys stand in for the missing content hashes.
    fresh = [dataclasses.replace(r, case_hash="sha256:" + "1" * 64, model_sha256="ab" * 32) for r in records]
    fresh[0] = dataclasses.replace(fresh[0], expected="C")
    code, out = as_json(old, write(tmp_path / "fresh.trace", fresh))
    assert next(w for w in out["warnings"] if w["kind"] == "pin")["cases"] == ["sanity/choice-capital-france"]


def test_texts_with_block_marker_lines_round_trip_into_the_comparison(tmp_path):
    tricky = "%%end\n%%case 9 v1\nindex: 9\n%%block MODEL_OUTPUT chars=3\n%%%end\nAnswer: 4"
    base = [rec(1, model_output=tricky, question_prompt="%%end\nWhat is 1?"), rec(2)]
    new = [rec(1, "FAILED", "5", model_output=tricky.replace("Answer: 4", "Answer: 5"),
               question_prompt="%%end\nWhat is 1?"), rec(2)]
    b, n = pair(tmp_path, base, new)
    assert [r.model_output for r in tr.read_trace(b).records][0] == tricky
    code, out = as_json(b, n)
    assert [(f["id"], f["base_picked"], f["new_picked"]) for f in out["flips"]] == [("c1", "4", "5")]
    assert out["base"]["cases"] == out["new"]["cases"] == 2 and out["warnings"] == []


def test_truncated_trace_tail_is_a_warning(tmp_path):
    recs = [rec(i) for i in range(1, 4)]
    b = write(tmp_path / "b.trace", recs)
    n = tmp_path / "n.trace"
    n.write_text("".join(map(tr.format_record, recs)) + tr.format_record(rec(4))[:60])
    code, out = as_json(b, n)
    assert code == 0 and any(w["kind"] == "trace" and "truncated" in w["message"] for w in out["warnings"])


def test_summaries_compare_with_traces(tmp_path):
    base = [rec(i) for i in range(1, 5)]
    summary = {"format": "ds4eval-summary", "version": 1, "suite": "toy", "backend": "engine", "model": "Toy 1B",
               "settings": {"tokens": 128, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "seed": None,
                            "think": False},
               "provenance": {"model_sha256": "ab" * 32, "kv_type": "float32"},
               "cases": [{"number": i, "source": "toy", "id": f"c{i}", "status": "FAILED" if i == 2 else "PASSED",
                          "picked": "3" if i == 2 else "4", "expected": "4", "prompt_tokens": 20, "gen_tokens": 9,
                          "elapsed_s": 0.4, "case_hash": f"sha256:{i:064x}", "prompt_sha256": f"{i:064x}"}
                         for i in range(1, 5)]}
    s = tmp_path / "new.json"
    s.write_text(json.dumps(summary))
    code, out = as_json(write(tmp_path / "b.trace", base), s)
    assert out["new"]["kind"] == "summary" and out["total"]["cases"] == 4
    assert [(f["id"], f["direction"]) for f in out["flips"]] == [("c2", "pass->fail")]
    assert ("kv_type", "float16", "float32", 4) in {(d["field"], d["base"], d["new"], d["cases"])
                                                    for d in out["differences"]}


def test_a_summary_from_before_provenance_compares_by_key(tmp_path):
    base = [rec(i) for i in range(1, 4)]
    summary = {"format": "ds4eval-summary", "version": 1, "suite": "toy", "backend": "engine", "model": "Toy 1B",
               "settings": {"tokens": 128, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "seed": None},
               "cases": [{"number": i, "source": "toy", "id": f"c{i}", "status": "PASSED", "picked": "4",
                          "expected": "5" if i == 3 else "4"} for i in range(1, 4)]}
    s = tmp_path / "old.json"
    s.write_text(json.dumps(summary))
    code, out = as_json(write(tmp_path / "b.trace", base), s)
    kinds = {w["kind"]: w for w in out["warnings"]}
    assert kinds["pin"]["cases"] == ["toy/c3"] and "provenance" in kinds  # no hashes: the keys decide
    assert out["total"]["cases"] == 2 and code == 0


def test_a_summary_written_by_a_run_compares(tmp_path, monkeypatch):
    """Summaries from `--summary` carry the case and prompt hashes and the run's provenance."""
    from engine_fakes import FAKE_ENGINE, FakeModel

    from ds4eval.run.backends import engine_backend

    replies = {"What is 2 + 3?": "Answer: 5"}
    monkeypatch.setattr(engine_backend.EngineBackend, "load", classmethod(
        lambda cls, cfg, note=None: cls(FakeModel(lambda p: next((a for q, a in replies.items() if q in p), "no idea")),
                             FAKE_ENGINE)))
    paths = []
    for name in ("a", "b"):
        s, t = tmp_path / f"{name}.json", tmp_path / f"{name}.trace"
        r = CliRunner().invoke(cli.main, ["--plain", "--domain", "arithmetic", "--summary", str(s), "--trace", str(t)])
        assert r.exit_code == 0, r.output
        paths.append((s, t))
        replies["What is 2 + 3?"] = "Answer: 6"
    summary = json.loads(paths[0][0].read_text())
    assert summary["provenance"]["extractor_version"] and summary["cases"][0]["case_hash"].startswith("sha256:")
    assert summary["cases"][0]["prompt_sha256"]
    for base, new in ((paths[0][0], paths[1][0]), (paths[0][1], paths[1][1]), (paths[0][0], paths[1][1])):
        code, out = as_json(base, new)
        assert [(f["id"], f["direction"]) for f in out["flips"]] == [("int-add-small", "pass->fail")], (base, new)
        assert out["total"]["cases"] == 6 and out["warnings"] == []


def test_text_and_markdown_have_every_section(tmp_path):
    base = [rec(i, source="alpha" if i < 4 else "beta") for i in range(1, 7)]
    new = [rec(1, "FAILED", None, source="alpha", gen_tokens=90)] + base[1:]
    b, n = pair(tmp_path, base, new)
    text = invoke(b, n).output
    for part in ("Runs", "Pass rates", "95% CI", "McNemar p", "mid-p", "Flips", "pass→fail", "Tokens and time",
                 "tokens/s", "11 → 90 (+79)", "Largest changes in generated length", "Verdict", "alpha", "beta",
                 "TOTAL"):
        assert part in text, part
    md = invoke(b, n, "--format", "markdown").output
    assert md.startswith("## ds4-eval --compare") and "### Flips" in md and "| alpha " in md
    assert "**no significant regression" in md and "no answer found" in md


# ---------------------------------------------------------------- repeated runs

def _repeat_trace(path, counts, k=5):
    """counts: case id -> passes of k repeats (the first `passes` repeats pass)."""
    from ds4eval.run import trace as trace_mod
    recs = []
    for n, (cid, passes) in enumerate(counts.items(), start=1):
        for r in range(k):
            ok = r < passes
            recs.append(trace_mod.TraceRecord(
                index=n, source="s", id=cid, status="PASSED" if ok else "FAILED", picked="4" if ok else "5",
                expected="4", answer_kind="integer", case_hash=f"sha256:{n:064x}", model="m", model_sha256="ab" * 32,
                temperature=0.7, seed=1 + r, repeat=r, model_output="Answer: 4" if ok else "Answer: 5"))
    header = trace_mod.RunHeader("s", tuple((n, "s", c) for n, c in enumerate(counts, start=1)), k)
    path.write_text(trace_mod.format_run_header(header) + "".join(map(trace_mod.format_record, recs)))
    return str(path)


def test_repeated_runs_are_judged_on_pass_counts_and_flaky_cases_are_not_regressions(tmp_path):
    from click.testing import CliRunner
    from ds4eval import cli

    base = _repeat_trace(tmp_path / "b.trace", {"a": 5, "b": 3, "c": 0, "d": 5, "e": 2})
    new = _repeat_trace(tmp_path / "n.trace", {"a": 0, "b": 1, "c": 0, "d": 4, "e": 5})
    r = CliRunner().invoke(cli.main, ["--compare", base, new, "--format", "json"])
    assert r.exit_code == 0, r.output  # 3 cases fell, 1 rose: the sign test is far from significant
    rep = json.loads(r.output)["repeats"]
    assert rep["base_repeats"] == rep["new_repeats"] == 5
    assert rep["drops"] == ["s/a"] and rep["flaky_drops"] == ["s/b"]
    assert rep["became_flaky"] == ["s/d"] and rep["stopped_flaky"] == ["s/e"]
    assert rep["sign_test"]["fell"] == 3 and rep["sign_test"]["rose"] == 1
    a = next(c for c in rep["cases"] if c["id"] == "a")
    assert a["p_drop"] == pytest.approx(1 / 252)  # 5/5 against 0/5: one table of C(10, 5) as extreme
    text = CliRunner().invoke(cli.main, ["--compare", base, new])
    assert "Significant drops" in text.output and "Flaky in BASE, lower in NEW" in text.output
    assert "Pass rates (repeat 0 of each case)" in text.output
    # --strict fails on the significant per-case drop alone.
    strict = CliRunner().invoke(cli.main, ["--compare", base, new, "--strict"])
    assert strict.exit_code == 1 and "1 case(s) with a significant drop" in strict.output


def test_many_small_drops_over_repeats_are_a_significant_regression(tmp_path):
    from click.testing import CliRunner
    from ds4eval import cli

    ids = [f"c{i}" for i in range(8)]
    base = _repeat_trace(tmp_path / "b.trace", dict.fromkeys(ids, 5))
    new = _repeat_trace(tmp_path / "n.trace", dict.fromkeys(ids, 3))
    r = CliRunner().invoke(cli.main, ["--compare", base, new, "--format", "json"])
    out = json.loads(r.output)
    assert r.exit_code == 1 and out["regression"] and out["repeats"]["drops"] == []
    assert out["repeats"]["sign_test"]["p_exact"] == pytest.approx(2 / 256)
    assert "significant regression: 8 case(s) passed less often" in out["verdict"]


# ---------------------------------------------------------------- a serial run against one under load

def _timed(i, concurrency, slower, **kw):
    return rec(i, concurrency=concurrency, ttft_s=0.1 * i * slower, itl_s=0.01 * slower, itl_max_s=0.05 * slower,
               itl_per="token", e2e_s=1.0 * i * slower, **kw)


def test_a_concurrency_difference_is_a_note_and_the_time_table_shows_both_latencies(tmp_path):
    from ds4eval.reports import comparison as report

    base = [_timed(i, 1, 1) for i in range(1, 11)]
    new = [_timed(i, 8, 4) for i in range(1, 10)] + [_timed(10, 8, 4, status="FAILED", picked="5")]
    b, n = pair(tmp_path, base, new)
    code, out = as_json(b, n)
    assert code == 0 and out["total"]["cases"] == 10  # kept in the verdict: load is the change under test
    assert out["differences"] == [{"field": "concurrency", "base": "1", "new": "8", "cases": 10}]
    assert not any("concurrency" in w["message"] for w in out["warnings"])

    c = cmp.compare(cmp.read_run(Path(b).read_text(), "BASE"), cmp.read_run(Path(n).read_text(), "NEW"))
    table = report.time_table(c)
    assert table.columns[-3:] == ("TTFT p50/p90 s", "ITL p50/p90 ms", "e2e p50/p90 s")
    total = [cell.text for cell in table.rows[-1].cells]
    assert total[0] == "TOTAL"
    assert total[-3:] == ["0.500/0.900 → 2.000/3.600", "10.0/10.0 → 40.0/40.0", "5.000/9.000 → 20.000/36.000"]
    text = invoke(b, n).output
    assert "TTFT p50/p90 s" in text and "concurrency" in text.split("What differs between the runs", 1)[1]
    from ds4eval.reports import formats

    page = formats.render_comparison(c, "html")
    assert "ITL p50/p90 ms" in page and "10.0/10.0 → 40.0/40.0" in page


def test_the_time_table_has_no_latency_unless_both_sides_carry_it(tmp_path):
    from ds4eval.reports import comparison as report

    base = [rec(i) for i in range(1, 5)]
    new = [_timed(i, 8, 1) for i in range(1, 5)]
    c = cmp.compare(cmp.read_run("".join(map(tr.format_record, base)), "BASE"),
                    cmp.read_run("".join(map(tr.format_record, new)), "NEW"))
    assert report.time_table(c).columns == ("source", "generated tokens", "generation s", "tokens/s",
                                            "prompt tokens")
    assert c.differences == []  # an unknown concurrency (an older trace) is no difference


# ---------------------------------------------------------------- two stacks, one model file

def stack(records, *, model, eos, backend="openai", **kw):
    """The records as one serving stack wrote them: its model name and token counting rule."""
    return [dataclasses.replace(r, model=model, served_model=model, backend=backend, gen_tokens_eos=eos, **kw)
            for r in records]


def test_the_same_file_served_under_two_names_is_one_model(tmp_path):
    recs = [rec(i) for i in range(1, 6)]
    base = stack(recs, model="smollm2", eos="yes")
    new = stack(recs, model="/models/SmolLM2-135M.gguf", eos="yes")
    code, out = as_json(*pair(tmp_path, base, new))
    assert code == 0 and out["total"]["cases"] == 5 and not [w for w in out["warnings"] if w["kind"] == "model"]
    assert ("served_model", "smollm2", "/models/SmolLM2-135M.gguf", 5) in \
        {(d["field"], d["base"], d["new"], d["cases"]) for d in out["differences"]}
    other = stack(recs, model="/models/SmolLM2-135M.gguf", eos="yes", model_sha256="cd" * 32)
    code, out = as_json(*pair(tmp_path, base, other), "--allow-diff", "model")
    assert next(w for w in out["warnings"] if w["kind"] == "model")


def test_token_counts_are_brought_to_one_rule_and_the_comparison_says_so(tmp_path):
    # BASE counts the end-of-sequence token (ds4-server), NEW does not (llama.cpp): the same replies.
    replies = [rec(i, gen_tokens=20 + i) for i in range(1, 5)] + [rec(5, gen_tokens=128)]  # c5 hit its budget
    base = stack(replies, model="smollm2", eos="yes")
    new = stack([dataclasses.replace(r, gen_tokens=r.gen_tokens - (r.gen_tokens < 128)) for r in replies],
                model="/models/SmolLM2-135M.gguf", eos="no")
    code, out = as_json(*pair(tmp_path, base, new))
    (note,) = [w for w in out["warnings"] if w["kind"] == "tokens"]
    assert "BASE counts the end-of-sequence token" in note["message"] and "NEW does not" in note["message"]
    assert "BASE's counts are taken without it" in note["message"] and "4 matched case(s)" in note["message"]
    assert note["excluded"] is False and out["token_counting"] == \
        {"base_counts_eos": "yes", "new_counts_eos": "no", "aligned": True}
    assert out["total"]["base_gen_tokens"] == out["total"]["new_gen_tokens"] and out["length_changes"] == []
    text = invoke(*pair(tmp_path, base, new)).output
    assert "generated tokens (without end-of-sequence)" in text and "token counts follow different rules" in text


def test_an_unknown_counting_rule_on_one_side_is_a_warning_without_adjustment(tmp_path):
    recs = [rec(i) for i in range(1, 4)]
    code, out = as_json(*pair(tmp_path, stack(recs, model="a", eos="yes"), stack(recs, model="b", eos="")))
    (note,) = [w for w in out["warnings"] if w["kind"] == "tokens"]
    assert "NEW does not say whether it counts" in note["message"] and "may be off by one" in note["message"]
    assert out["token_counting"]["aligned"] is False
    code, out = as_json(*pair(tmp_path, stack(recs, model="a", eos=""), stack(recs, model="b", eos="")))
    assert not [w for w in out["warnings"] if w["kind"] == "tokens"]
