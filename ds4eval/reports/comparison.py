"""Rendering a `compare.Comparison`: text for a terminal, markdown for CI logs and pull requests,
JSON for programs.

Contract
- `tables(cmp) -> dict[str, pandas.DataFrame]`: the result tables (runs, pass rates, flips,
  tokens and time, length changes, differences), already formatted for display.
- `render(cmp, fmt)` with fmt "text" (tables through tabulate), "markdown" (pipe tables through
  pandas' `to_markdown`) or "json" (`as_json(cmp)`, numbers unformatted). Pure.
- `flip_summary(cmp)` and `method_note(cmp)`: the one-line texts under Flips and Pass rates,
  shared with the HTML page (`reports.html`).
- When both runs have repeats, `repeat_case_rows(rc)` is the per-case table (k/K on each side,
  Fisher p, class change), smallest p first; markdown shows its first MARKDOWN_CASE_ROWS rows,
  the HTML page all of them, and the terminal text none (it lists only the cases that moved).
It computes nothing new: every figure comes from the Comparison.
"""

from __future__ import annotations

import json
from collections import Counter

import pandas as pd
from tabulate import tabulate

from ds4eval.verdict.compare import Comparison, Flip, RenderDiff, RepeatCase, RepeatComparison, Run, SourceStats

ARROW = {"pass->fail": "pass→fail", "fail->pass": "fail→pass"}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return f"{100 * x:+.1f}"


def _p(x: float) -> str:
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def _picked(p: str | None) -> str:
    p = "" if p is None else p
    return "(none)" if not p else (p if len(p) <= 40 else p[:37] + "...")


def _common(values: list[str]) -> str:
    """The value most cases of a run share, with a note when they do not all share it."""
    counts = Counter(values)
    value, n = counts.most_common(1)[0]
    value = value or "-"
    return value if n == len(values) else f"{value} (+{len(counts) - 1} other value(s))"


def _run_rows(run: Run) -> dict:
    cols = list(zip(*((c.model, c.model_sha256[:12], c.setting("backend"), c.setting("kv_type"),
                       c.setting("ds4eval_version"), c.setting("git_commit")) for c in run.cases.values())))
    model, sha, backend, kv, version, commit = map(_common, cols)
    return {
        "run": run.label, "kind": run.kind, "suite": run.suite or "-", "cases": len(run.cases),
        "model": model, "model sha256": sha, "backend": backend, "kv cache": kv,
        "ds4eval": version + (f" @ {commit[:12]}{'+dirty' if commit.endswith('+dirty') else ''}"
                              if commit != "-" else ""),
    }


def _rate_row(s: SourceStats) -> dict:
    iv = s.interval
    return {
        "source": s.source, "cases": s.cases,
        "BASE passed": f"{s.base_passed}/{s.cases} ({_pct(s.base_rate)})",
        "NEW passed": f"{s.new_passed}/{s.cases} ({_pct(s.new_rate)})",
        "delta pp": _pp(iv.delta), "95% CI pp": f"[{_pp(iv.low)}, {_pp(iv.high)}]",
        "pass→fail": s.pass_fail, "fail→pass": s.fail_pass,
        "McNemar p": _p(s.test.p_exact), "mid-p": _p(s.test.mid_p),
    }


def _moved(base: float, new: float, fmt: str) -> str:
    return f"{base:{fmt}} → {new:{fmt}} ({new - base:+{fmt}})"


def _time_row(s: SourceStats) -> dict:
    return {
        "source": s.source,
        "generated tokens": _moved(s.base_gen_tokens, s.new_gen_tokens, "d"),
        "generation s": _moved(s.base_gen_s, s.new_gen_s, ".1f"),
        "tokens/s": _moved(s.base_tok_s, s.new_tok_s, ".1f"),
        "prompt tokens": _moved(s.base_prompt_tokens, s.new_prompt_tokens, "d"),
    }


def _flip_row(f: Flip) -> dict:
    expected = f.base_expected if f.base_expected == f.new_expected else f"{f.base_expected} | {f.new_expected}"
    if f.direction == "pass->fail":
        kind = "no answer found" if f.no_answer else "wrong answer"
    else:
        kind = "was no answer" if f.no_answer else "was a wrong answer"
    return {"flip": ARROW[f.direction], "case": f.name, "BASE picked": _picked(f.base_picked),
            "NEW picked": _picked(f.new_picked), "expected": expected, "kind": kind}


def tables(cmp: Comparison) -> dict[str, pd.DataFrame]:
    per_source = cmp.sources if len(cmp.sources) > 1 else []
    return {
        "runs": pd.DataFrame([_run_rows(cmp.base), _run_rows(cmp.new)]),
        "rates": pd.DataFrame([_rate_row(s) for s in per_source + [cmp.total]]),
        "flips": pd.DataFrame([_flip_row(f) for f in cmp.flips],
                              columns=["flip", "case", "BASE picked", "NEW picked", "expected", "kind"]),
        "time": pd.DataFrame([_time_row(s) for s in per_source + [cmp.total]]),
        "lengths": pd.DataFrame([{"case": f"{c.source}/{c.id}",
                                  "generated tokens": _moved(c.base_gen_tokens, c.new_gen_tokens, "d"),
                                  "BASE": c.base_status, "NEW": c.new_status} for c in cmp.length_changes],
                                columns=["case", "generated tokens", "BASE", "NEW"]),
        "differences": pd.DataFrame([{"field": d.field, "BASE": d.base, "NEW": d.new, "cases": d.cases}
                                     for d in cmp.differences], columns=["field", "BASE", "NEW", "cases"]),
    }


def _piece(p: str) -> str:
    return p.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _context(d: RenderDiff, side: tuple[str, ...]) -> str:
    if d.position is None:
        return _piece(side[0]) if side else ""
    shown = []
    for i, p in enumerate(side, d.context_start):
        shown.append(f"⟦{_piece(p)}⟧" if i == d.position else _piece(p))
    if not side or d.context_start + len(side) <= d.position:
        shown.append("⟦(end)⟧")
    lead = "…" if d.context_start > 0 else ""
    return lead + "|".join(shown) + "|…"


def _render_diff_lines(d: RenderDiff) -> list[str]:
    names = ", ".join(d.cases[:4]) + (f" and {len(d.cases) - 4} more" if len(d.cases) > 4 else "")
    where = f"first difference at token {d.position}" if d.position is not None else d.note
    lines = [f"{len(d.cases)} case(s) ({names}): {where} (BASE {d.base_tokens} tokens, NEW {d.new_tokens})"]
    if d.base_context or d.new_context:
        lines += [f"  BASE {_context(d, d.base_context)}", f"  NEW  {_context(d, d.new_context)}"]
    return lines


def flip_summary(cmp: Comparison) -> str:
    """One line: the flips by kind and the unparsed answers on each side."""
    t = cmp.total
    return (f"pass→fail {t.pass_fail} ({t.pass_fail - t.pass_fail_no_answer} wrong answer, "
            f"{t.pass_fail_no_answer} no answer found); fail→pass {t.fail_pass} "
            f"({t.fail_pass_no_answer} of them had found no answer in BASE); no answer found among failures: "
            f"BASE {t.base_no_answer}, NEW {t.new_no_answer}")


def method_note(cmp: Comparison) -> str:
    """One line: what the delta, its interval and the p-values are."""
    iv = cmp.total.interval
    return (f"delta = NEW rate - BASE rate on the {cmp.total.cases} comparable cases; 95% CI: paired bootstrap "
            f"over cases, {iv.resamples:,} resamples, seed {iv.seed}; p: exact McNemar (two-sided binomial test "
            f"of the {cmp.total.test.discordant} discordant cases), mid-p beside it")


REPEAT_COLUMNS = ["case", "BASE k/K", "NEW k/K", "BASE class", "NEW class", "Fisher p (drop)", "Fisher p (rise)"]


def _repeat_row(r: RepeatCase) -> dict:
    return {"case": r.name, "BASE k/K": f"{r.base_passed}/{r.base_graded}", "NEW k/K": f"{r.new_passed}/{r.new_graded}",
            "BASE class": r.base_class, "NEW class": r.new_class, "Fisher p (drop)": _p(r.p_drop),
            "Fisher p (rise)": _p(r.p_rise)}


def _repeat_sections(rc: RepeatComparison, alpha: float) -> list[tuple[str, object]]:
    iv, t = rc.interval, rc.test
    lines = [f"repeats: BASE {rc.base_repeats}, NEW {rc.new_repeats}; pass@1 (mean share of passing repeats) "
             f"BASE {_pct(rc.base_pass_at_1)}, NEW {_pct(rc.new_pass_at_1)}, delta {_pp(iv.mean)} pp "
             f"(95% CI [{_pp(iv.low)}, {_pp(iv.high)}], bootstrap over cases, {iv.resamples:,} resamples, "
             f"seed {iv.seed})",
             f"cases passing less often {t.b}, more often {t.c} (sign test, exact p {_p(t.p_exact)}, mid-p "
             f"{_p(t.mid_p)}); per case: Fisher's exact test of k/K on both sides, alpha {alpha:g}"]
    out: list[tuple[str, object]] = [("Repeats", lines)]
    for title, rows in (("Significant drops", rc.drops), ("Significant rises", rc.rises),
                        ("Flaky in BASE, lower in NEW, not significant (not a regression)", rc.flaky_drops),
                        ("Became flaky", rc.became_flaky), ("Stopped being flaky", rc.stopped_flaky)):
        if rows:
            out.append((title, pd.DataFrame([_repeat_row(r) for r in rows], columns=REPEAT_COLUMNS)))
    return out


CASE_TABLE_COLUMNS = ["case", "BASE k/K", "NEW k/K", "Fisher p", "class BASE → NEW", "change"]
MARKDOWN_CASE_ROWS = 50  # the per-case table of a markdown report stops here (the HTML page has all)


def both_repeated(rc: RepeatComparison | None) -> bool:
    """Whether both runs have repeats, so that every case has a k/K on each side to compare."""
    return rc is not None and rc.base_repeats > 1 and rc.new_repeats > 1


def repeat_case_rows(rc: RepeatComparison, limit: int | None = None) -> list[dict]:
    """The per-case table of a repeat comparison, the smallest Fisher p first (`limit` rows at most)."""
    ranked = rc.ranked()
    return [{"case": r.name, "BASE k/K": f"{r.base_passed}/{r.base_graded}",
             "NEW k/K": f"{r.new_passed}/{r.new_graded}", "Fisher p": _p(r.p),
             "class BASE → NEW": r.base_class if r.base_class == r.new_class else f"{r.base_class} → {r.new_class}",
             "change": rc.change(r)} for r in ranked[:limit]]


def repeat_case_note(rc: RepeatComparison, shown: int, alpha: float) -> str:
    """One line under the per-case table: what p is and how many rows are shown."""
    cut = f"; the {shown} smallest p of {len(rc.cases)} cases" if shown < len(rc.cases) else ""
    return ("Fisher p: Fisher's exact test of the k/K counts, one-sided in the direction the pass share "
            f"moved; regressed / improved: p < {alpha:g}{cut}")


def _case_table_sections(cmp: Comparison) -> list[tuple[str, object]]:
    rc = cmp.repeats
    if not both_repeated(rc):
        return []
    rows = repeat_case_rows(rc, MARKDOWN_CASE_ROWS)
    return [("Per case, by Fisher p", pd.DataFrame(rows, columns=CASE_TABLE_COLUMNS)),
            ("", [repeat_case_note(rc, len(rows), cmp.alpha)])]


def _sections(cmp: Comparison, case_table: bool = False) -> list[tuple[str, object]]:
    """(title, content) in display order; content is a DataFrame or a list of lines. The per-case
    table of a repeat comparison (`case_table`) is for reports read as pages, not for terminals."""
    tb = tables(cmp)
    first = " (repeat 0 of each case)" if cmp.repeats is not None else ""
    out: list[tuple[str, object]] = [
        ("Runs", tb["runs"]),
        *(_repeat_sections(cmp.repeats, cmp.alpha) if cmp.repeats is not None else []),
        *(_case_table_sections(cmp) if case_table else []),
        ("Pass rates" + first, tb["rates"]),
        ("", [method_note(cmp)]),
        ("Flips" + first, [flip_summary(cmp)]),
    ]
    if len(tb["flips"]):
        out.append(("", tb["flips"]))
    if cmp.lost_passes:
        out.append(("", [f"lost passes (passed in BASE, no verdict in NEW): {', '.join(cmp.lost_passes)}"]))
    out.append(("Tokens and time", tb["time"]))
    if len(tb["lengths"]):
        out.append(("Largest changes in generated length", tb["lengths"]))
    if len(tb["differences"]):
        out.append(("What differs between the runs", tb["differences"]))
    if cmp.render_diffs:
        out.append(("Render diff", [line for d in cmp.render_diffs for line in _render_diff_lines(d)]))
    if cmp.issues:
        out.append(("Warnings", [i.message for i in cmp.issues]))
    out.append(("Verdict", [cmp.verdict]))
    return out


def render_text(cmp: Comparison) -> str:
    lines = [f"ds4-eval --compare  BASE {cmp.base.label}  NEW {cmp.new.label}"]
    for title, body in _sections(cmp):
        lines.append("")
        if title:
            lines.append(title)
        if isinstance(body, pd.DataFrame):
            lines.append(tabulate(body, headers="keys", showindex=False, tablefmt="simple", disable_numparse=True))
        elif title == "Warnings":
            lines += [f"- {b}" for b in body]
        else:
            lines += body
    return "\n".join(lines) + "\n"


def render_markdown(cmp: Comparison) -> str:
    lines = [f"## ds4-eval --compare: `{cmp.base.label}` → `{cmp.new.label}`", "",
             f"**{cmp.verdict}**"]
    for title, body in _sections(cmp, case_table=True):
        if title == "Verdict":
            continue
        lines.append("")
        if title:
            lines += [f"### {title}", ""]
        if isinstance(body, pd.DataFrame):
            lines.append(body.to_markdown(index=False, disable_numparse=True))
        elif title == "Render diff":
            lines += ["```", *body, "```"]
        elif title == "Warnings":
            lines += [f"- {b}" for b in body]
        else:
            lines += body
    return "\n".join(lines) + "\n"


def _stats_json(s: SourceStats) -> dict:
    iv, t = s.interval, s.test
    return {"source": s.source, "cases": s.cases, "base_passed": s.base_passed, "new_passed": s.new_passed,
            "base_rate": s.base_rate, "new_rate": s.new_rate, "delta": iv.delta,
            "interval": {"low": iv.low, "high": iv.high, "level": iv.level, "resamples": iv.resamples,
                         "seed": iv.seed},
            "mcnemar": {"pass_fail": t.b, "fail_pass": t.c, "p_exact": t.p_exact, "mid_p": t.mid_p},
            "pass_fail_no_answer": s.pass_fail_no_answer, "fail_pass_no_answer": s.fail_pass_no_answer,
            "base_no_answer": s.base_no_answer, "new_no_answer": s.new_no_answer,
            "base_gen_tokens": s.base_gen_tokens, "new_gen_tokens": s.new_gen_tokens,
            "base_gen_s": round(s.base_gen_s, 3), "new_gen_s": round(s.new_gen_s, 3),
            "base_tokens_per_s": round(s.base_tok_s, 2), "new_tokens_per_s": round(s.new_tok_s, 2),
            "base_prompt_tokens": s.base_prompt_tokens, "new_prompt_tokens": s.new_prompt_tokens}


def as_json(cmp: Comparison) -> dict:
    def run(r: Run) -> dict:
        return {"label": r.label, "kind": r.kind, "suite": r.suite, "cases": len(r.cases), "repeated": r.repeated}

    return {
        "format": "ds4eval-comparison", "version": 1,
        "base": run(cmp.base), "new": run(cmp.new),
        "alpha": cmp.alpha, "strict": cmp.strict, "allowed": list(cmp.allowed),
        "verdict": cmp.verdict, "regression": cmp.regression, "exit_status": cmp.exit_status,
        "total": _stats_json(cmp.total), "sources": [_stats_json(s) for s in cmp.sources],
        "flips": [{"source": f.source, "id": f.id, "direction": f.direction, "base_picked": f.base_picked,
                   "new_picked": f.new_picked, "base_expected": f.base_expected, "new_expected": f.new_expected,
                   "no_answer": f.no_answer} for f in cmp.flips],
        "lost_passes": cmp.lost_passes,
        "length_changes": [{"source": c.source, "id": c.id, "base_gen_tokens": c.base_gen_tokens,
                            "new_gen_tokens": c.new_gen_tokens, "delta": c.delta} for c in cmp.length_changes],
        "differences": [{"field": d.field, "base": d.base, "new": d.new, "cases": d.cases} for d in cmp.differences],
        "render_diffs": [{"cases": list(d.cases), "position": d.position, "base_tokens": d.base_tokens,
                          "new_tokens": d.new_tokens, "context_start": d.context_start,
                          "base_context": list(d.base_context), "new_context": list(d.new_context), "note": d.note}
                         for d in cmp.render_diffs],
        "warnings": [{"kind": i.kind, "message": i.message, "cases": list(i.cases), "excluded": i.excluded}
                     for i in cmp.issues],
        "cases": json.loads(cmp.cases.to_json(orient="records")),
        "repeats": None if cmp.repeats is None else _repeats_json(cmp.repeats),
    }


def _repeats_json(rc: RepeatComparison) -> dict:
    def case(r: RepeatCase) -> dict:
        return {"source": r.source, "id": r.id, "base_passed": r.base_passed, "base_graded": r.base_graded,
                "new_passed": r.new_passed, "new_graded": r.new_graded, "base_class": r.base_class,
                "new_class": r.new_class, "p_drop": r.p_drop, "p_rise": r.p_rise}

    iv, t = rc.interval, rc.test
    return {"base_repeats": rc.base_repeats, "new_repeats": rc.new_repeats,
            "base_pass_at_1": rc.base_pass_at_1, "new_pass_at_1": rc.new_pass_at_1,
            "delta": {"mean": iv.mean, "low": iv.low, "high": iv.high, "resamples": iv.resamples, "seed": iv.seed},
            "sign_test": {"fell": t.b, "rose": t.c, "p_exact": t.p_exact, "mid_p": t.mid_p},
            "cases": [case(r) for r in rc.cases],
            **{k: [r.name for r in getattr(rc, k)]
               for k in ("drops", "rises", "flaky_drops", "became_flaky", "stopped_flaky")}}


def render_json(cmp: Comparison) -> str:
    return json.dumps(as_json(cmp), indent=1, ensure_ascii=False) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json}


def render(cmp: Comparison, fmt: str = "text") -> str:
    return RENDERERS[fmt](cmp)
