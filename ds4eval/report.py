"""Run reports: totals, per-source table, JSON summary, and the `--plain` listener.

Contract
- `build_summary(states, wall_s, info) -> dict` is pure: the JSON summary a later run can be
  compared with (schema below; `ds4-eval --compare` reads it, see `ds4eval.compare`).
  `render_report(summary) -> str` renders the final text report (tabulate).
- `PlainListener(stream)` prints one line per finished case; thread-safe.
Summary schema (version 1): {"format": "ds4eval-summary", "version", "suite", "backend",
"model", "settings": {...}, "provenance": {the run-level fields of `ds4eval.provenance`},
"wall_s", "totals": {cases, passed, failed, skipped, stopped, error, pending, prompt_tokens,
gen_tokens, gen_s, tokens_per_s}, "sources": [{source, cases, passed, failed, other,
prompt_tokens, gen_tokens, gen_s, tokens_per_s}], "cases": [{number, source, id, status,
picked, expected, prompt_tokens, gen_tokens, elapsed_s, think_close, case_hash,
prompt_sha256}]}. Summaries written before provenance lack those keys.
It does not run cases or write files (the CLI writes the summary atomically).
"""

from __future__ import annotations

import sys
import threading
from typing import Iterable, TextIO

from tabulate import tabulate

from ds4eval.cases import case_hash
from ds4eval.runner import CaseFinished, CaseState, Status

SUMMARY_VERSION = 1


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 2) if seconds > 0 else 0.0


def build_summary(states: Iterable[CaseState], wall_s: float, info: dict) -> dict:
    states = list(states)
    counts = {s: 0 for s in ("passed", "failed", "skipped", "stopped", "error", "pending")}
    by_source: dict[str, dict] = {}
    for st in states:
        key = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "STOPPED": "stopped",
               "ERROR": "error"}.get(st.status.value, "pending")
        counts[key] += 1
        row = by_source.setdefault(st.case.source, {"source": st.case.source, "cases": 0, "passed": 0,
                                                    "failed": 0, "other": 0, "prompt_tokens": 0,
                                                    "gen_tokens": 0, "gen_s": 0.0})
        row["cases"] += 1
        row[key if key in ("passed", "failed") else "other"] += 1
        row["prompt_tokens"] += st.prompt_tokens
        row["gen_tokens"] += st.gen_tokens
        row["gen_s"] += st.elapsed_s
    for row in by_source.values():
        row["gen_s"] = round(row["gen_s"], 3)
        row["tokens_per_s"] = _rate(row["gen_tokens"], row["gen_s"])
    gen_tokens = sum(s.gen_tokens for s in states)
    gen_s = round(sum(s.elapsed_s for s in states), 3)
    return {
        "format": "ds4eval-summary",
        "version": SUMMARY_VERSION,
        **info,
        "wall_s": round(wall_s, 3),
        "totals": {"cases": len(states), **counts,
                   "prompt_tokens": sum(s.prompt_tokens for s in states),
                   "gen_tokens": gen_tokens, "gen_s": gen_s, "tokens_per_s": _rate(gen_tokens, gen_s)},
        "sources": list(by_source.values()),
        "cases": [{"number": s.number, "source": s.case.source, "id": s.case.id, "status": s.status.value,
                   "picked": s.picked, "expected": s.case.answer, "prompt_tokens": s.prompt_tokens,
                   "gen_tokens": s.gen_tokens, "elapsed_s": round(s.elapsed_s, 3),
                   "think_close": s.think_close, "case_hash": case_hash(s.case),
                   "prompt_sha256": s.prompt.sha256 if s.prompt else ""} for s in states],
    }


def render_report(summary: dict) -> str:
    t = summary["totals"]
    rows = [[r["source"], r["cases"], r["passed"], r["failed"], r["other"], r["prompt_tokens"],
             r["gen_tokens"], f"{r['gen_s']:.1f}", f"{r['tokens_per_s']:.1f}"] for r in summary["sources"]]
    rows.append(["TOTAL", t["cases"], t["passed"], t["failed"],
                 t["cases"] - t["passed"] - t["failed"], t["prompt_tokens"], t["gen_tokens"],
                 f"{t['gen_s']:.1f}", f"{t['tokens_per_s']:.1f}"])
    table = tabulate(rows, headers=["source", "cases", "passed", "failed", "other", "prompt tok",
                                    "gen tok", "time s", "tok/s"], tablefmt="simple")
    graded = t["passed"] + t["failed"]
    pct = f"{100.0 * t['passed'] / t['cases']:.1f}%" if t["cases"] else "n/a"
    lines = [
        f"suite {summary.get('suite', '?')} | backend {summary.get('backend', '?')} | "
        f"model {summary.get('model', '?')}",
        table,
        f"passed {t['passed']}/{t['cases']} ({pct}); graded {graded}; skipped {t['skipped']}, "
        f"stopped {t['stopped']}, error {t['error']}, not run {t['pending']}",
        f"wall time {summary['wall_s']:.1f} s; generation {t['gen_tokens']} tokens in {t['gen_s']:.1f} s "
        f"({t['tokens_per_s']:.1f} tok/s)",
    ]
    return "\n".join(lines)


def case_line(st: CaseState, total: int) -> str:
    rate = _rate(st.gen_tokens, st.elapsed_s)
    width = len(str(total))
    picked = "-" if st.picked is None else st.picked
    if len(picked) > 40:
        picked = picked[:37] + "..."
    line = (f"[{st.number:>{width}}/{total}] {st.status.value:<7} {st.case.source}/{st.case.id}  "
            f"picked={picked} expected={st.case.answer}  "
            f"{st.gen_tokens} tok {st.elapsed_s:.1f}s {rate:.1f} tok/s")
    if st.think_close not in ("none", "natural"):
        line += f"  think-close={st.think_close}"
    if st.error:
        line += f"  ({st.error})"
    return line


class PlainListener:
    """Prints one line per finished case to `stream` (default stdout)."""

    def __init__(self, total: int, stream: TextIO | None = None):
        self.total = total
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def on_event(self, event: object) -> None:
        if isinstance(event, CaseFinished) and event.state.status is not Status.SWITCHED:
            with self._lock:
                print(case_line(event.state, self.total), file=self.stream, flush=True)
