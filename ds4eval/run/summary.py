"""Run reports: totals, per-source table, JSON summary, and the `--plain` listener.

Contract
- `build_summary(states, wall_s, info) -> dict` is pure: the JSON summary a later run can be
  compared with (schema below; `ds4-eval --compare` reads it, see `ds4eval.verdict.compare`).
  `render_report(summary) -> str` renders the final text report (tabulate).
- `PlainListener(stream)` prints one line per finished case; thread-safe.
Summary schema (version 1): {"format": "ds4eval-summary", "version", "suite", "backend",
"model", "settings": {...}, "provenance": {the run-level fields of `ds4eval.run.provenance`},
"wall_s", "totals": {cases, passed, failed, skipped, stopped, error, pending, prompt_tokens,
gen_tokens, gen_s, tokens_per_s, wall_tokens_per_s, tokens_known}, "sources": [{source, cases,
passed, failed, other, prompt_tokens, gen_tokens, gen_s, tokens_per_s}], "cases": [{number,
source, id, status, picked, expected, prompt_tokens, gen_tokens, elapsed_s, think_close,
case_hash, prompt_sha256, repeat, ttft_s, itl_s, itl_max_s, itl_per, e2e_s}], "latency": {concurrency,
cases, ttft_s, itl_s, e2e_s (each {count, p50, p90, p99, max} in seconds, or null), itl_per} when
any graded case measured its latency, "endpoints": [{url, requests, failures, removals,
out_of_rotation}] when the caller gives them (a run on several endpoints, or one whose endpoint
failed: `removals` counts the times it was taken out of rotation, `out_of_rotation` is its state
at the end), and with --repeats K > 1 "repeats": {k, counts (stable
pass, stable fail, flaky, ungraded), pass_at_1 {mean, low, high}, pass_at_k, pass_hat_k,
full_cases, flaky [{source, id, passed, graded}], nondeterministic [{source, id, repeat, token,
char, base_text, other_text}]} (`ds4eval.verdict.repeats`). Summaries written before provenance lack
those keys.
- `gen_s` sums the per-case generation clocks and `tokens_per_s` is per-case speed
  (gen_tokens / gen_s); `wall_tokens_per_s` is throughput (gen_tokens / wall_s), which is
  higher when cases run concurrently. Token counts that a backend could not know (a server
  that sends no usage, without --tokenizer) are null, and rendered "unknown", never guessed.
- Latency (`ds4eval.run.latency`): nearest-rank percentiles over the graded cases (PASSED or
  FAILED: their streams ran to the end), each case weighing one; ITL over the cases' mean gaps,
  its max the longest single gap. `concurrency` is the run's `settings.concurrency` (null when
  the caller did not give it). The text report shows them as a table under the totals.
- `eta_s(done, total, elapsed_s)` is the naive remaining time (average per finished case).
It does not run cases or write files (the CLI writes the summary atomically).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Iterable, TextIO

from tabulate import tabulate

from ds4eval.cases.case import case_hash
from ds4eval.run import latency as lt
from ds4eval.run.runner import CaseFinished, CaseState, RunStarted, Status
from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import repeats as rp

SUMMARY_VERSION = 1


def _rate(tokens: int | None, seconds: float) -> float | None:
    if tokens is None:
        return None
    return round(tokens / seconds, 2) if seconds > 0 else 0.0


def _counted(states: list[CaseState], name: str) -> int | None:
    """Sum of a token count over cases, None when a case that ran could not count it."""
    if any(not s.tokens_known for s in states):
        return None
    return sum(getattr(s, name) for s in states)


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    """Seconds left if the remaining cases take as long as the finished ones on average."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, elapsed_s / done * (total - done))


def format_clock(seconds: float | None) -> str:
    """h:mm:ss or m:ss; '?' when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _tok(n: int | None) -> str:
    return "unknown" if n is None else str(n)


def _per_s(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.1f}"


def build_summary(states: Iterable[CaseState], wall_s: float, info: dict) -> dict:
    states = list(states)
    counts = {s: 0 for s in ("passed", "failed", "skipped", "stopped", "error", "pending")}
    by_source: dict[str, dict] = {}
    for st in states:
        key = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "STOPPED": "stopped",
               "ERROR": "error"}.get(st.status.value, "pending")
        counts[key] += 1
        row = by_source.setdefault(st.case.source, {"source": st.case.source, "cases": 0, "passed": 0,
                                                    "failed": 0, "other": 0, "states": []})
        row["cases"] += 1
        row[key if key in ("passed", "failed") else "other"] += 1
        row["states"].append(st)
    for row in by_source.values():
        group = row.pop("states")
        row["prompt_tokens"] = _counted(group, "prompt_tokens")
        row["gen_tokens"] = _counted(group, "gen_tokens")
        row["gen_s"] = round(sum(s.elapsed_s for s in group), 3)
        row["tokens_per_s"] = _rate(row["gen_tokens"], row["gen_s"])
    gen_tokens = _counted(states, "gen_tokens")
    gen_s = round(sum(s.elapsed_s for s in states), 3)
    return {
        "format": "ds4eval-summary",
        "version": SUMMARY_VERSION,
        **info,
        "wall_s": round(wall_s, 3),
        "totals": {"cases": len(states), **counts,
                   "prompt_tokens": _counted(states, "prompt_tokens"),
                   "gen_tokens": gen_tokens, "gen_s": gen_s, "tokens_per_s": _rate(gen_tokens, gen_s),
                   "wall_tokens_per_s": _rate(gen_tokens, wall_s),
                   "tokens_known": gen_tokens is not None},
        "sources": list(by_source.values()),
        "cases": [{"number": s.number, "source": s.case.source, "id": s.case.id, "status": s.status.value,
                   "picked": s.picked, "expected": s.case.answer,
                   "prompt_tokens": s.prompt_tokens if s.tokens_known else None,
                   "gen_tokens": s.gen_tokens if s.tokens_known else None, "elapsed_s": round(s.elapsed_s, 3),
                   "think_close": s.think_close, "case_hash": case_hash(s.case),
                   "prompt_sha256": s.prompt.sha256 if s.prompt else "", "repeat": s.repeat,
                   **_case_latency(s.latency)} for s in states],
        **_latency_part(states, info),
        **({"repeats": repeat_summary(states, float(info.get("settings", {}).get("temperature") or 0.0))}
           if any(s.repeat for s in states) else {}),
    }


def _case_latency(lat: lt.Latency) -> dict:
    def sec(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    return {"ttft_s": sec(lat.ttft_s), "itl_s": sec(lat.itl_s), "itl_max_s": sec(lat.itl_max_s),
            "itl_per": lat.itl_per, "e2e_s": sec(lat.e2e_s)}


def _latency_part(states: list[CaseState], info: dict) -> dict:
    """{"latency": ...} over the graded cases, or nothing when none of them was measured."""
    found = lt.summarize(s.latency for s in states if s.status in (Status.PASSED, Status.FAILED))
    if found is None:
        return {}
    return {"latency": {"concurrency": info.get("settings", {}).get("concurrency"), **found.as_dict()}}


def repeat_summary(states: Iterable[CaseState], temperature: float) -> dict:
    """The --repeats part of the summary, from the finished states (see the module docstring)."""
    records = [TraceRecord(index=s.number, source=s.case.source, id=s.case.id, status=s.status.value,
                           repeat=s.repeat, temperature=temperature, model_output=s.output)
               for s in states if s.status.finished]
    summ = rp.summarize(rp.group(records))
    p1 = summ.pass_at_1
    return {
        "k": summ.repeats, "counts": summ.counts,
        "pass_at_1": None if p1 is None else {"mean": p1.mean, "low": p1.low, "high": p1.high},
        "pass_at_k": summ.pass_at_k, "pass_hat_k": summ.pass_hat_k, "full_cases": summ.full_cases,
        "flaky": [{"source": c.source, "id": c.id, "passed": c.passed, "graded": c.graded} for c in summ.flaky()],
        "nondeterministic": [{"source": c.source, "id": c.id, "repeat": c.difference.repeat,
                              "token": c.difference.token, "char": c.difference.char,
                              "base_text": c.difference.base_text, "other_text": c.difference.other_text}
                             for c in summ.nondeterministic],
    }


def _repeat_lines(rep: dict) -> list[str]:
    k, n = rep["k"], rep["counts"]
    lines = [f"repeats {k}: stable pass {n['stable pass']}, stable fail {n['stable fail']}, flaky {n['flaky']}"
             + (f", ungraded {n['ungraded']}" if n["ungraded"] else "")]
    p1 = rep["pass_at_1"]
    if p1 is not None:
        line = f"pass@1 {100 * p1['mean']:.1f}% (95% CI {100 * p1['low']:.1f}-{100 * p1['high']:.1f}, over cases)"
        if rep["pass_at_k"] is not None and k > 1:
            line += (f"; pass@{k} {100 * rep['pass_at_k']:.1f}%, pass^{k} {100 * rep['pass_hat_k']:.1f}% "
                     f"({rep['full_cases']} cases graded {k} times)")
        lines.append(line)
    for c in rep["flaky"]:
        lines.append(f"  flaky {c['source']}/{c['id']}: {c['passed']}/{c['graded']} passed")
    for c in rep["nondeterministic"]:
        lines.append(f"  non-deterministic {c['source']}/{c['id']}: repeat {c['repeat']} differs from repeat 0 "
                     f"at token {c['token']} (char {c['char']}): {c['base_text']!r} vs {c['other_text']!r}")
    return lines


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def _s(x: float) -> str:
    return f"{x:.3f}"


# (row label, summary key, unit's formatter, unit name) of the latency table
_LATENCY_ROWS = (("TTFT", "ttft_s", _s, "s"), ("ITL", "itl_s", _ms, "ms"), ("e2e", "e2e_s", _s, "s"))


def latency_lines(lat: dict) -> list[str]:
    """The latency part of the text report: a line saying what was measured, then a table."""
    conc = lat.get("concurrency")
    rows = []
    for label, key, fmt, unit in _LATENCY_ROWS:
        p = lat.get(key)
        per = f" per {lat['itl_per']}" if key == "itl_s" and lat.get("itl_per") else ""
        cells = [fmt(p[q]) for q in ("p50", "p90", "p99", "max")] if p else ["unknown"] * 4
        rows.append([f"{label} {unit}{per}", *cells])
    table = tabulate(rows, headers=["latency", "p50", "p90", "p99", "max"], tablefmt="simple",
                     disable_numparse=True, colalign=("left",) + ("right",) * 4)
    return [f"latency at concurrency {'?' if conc is None else conc}, over {lat['cases']} graded case(s) "
            f"(nearest-rank percentiles; ITL: each case's mean gap, max: the longest single gap)", table]


def endpoint_line(e: dict) -> str:
    """One endpoint of the run: its requests, failures and whether it ended out of rotation."""
    taken = f", taken out {e['removals']} time(s)" if e.get("removals") else ""
    return (f"endpoint {e['url']}: {e['requests']} request(s), {e['failures']} failed{taken}; "
            f"out of rotation: {'yes' if e['out_of_rotation'] else 'no'}")


def render_report(summary: dict) -> str:
    t = summary["totals"]
    rows = [[r["source"], r["cases"], r["passed"], r["failed"], r["other"], _tok(r["prompt_tokens"]),
             _tok(r["gen_tokens"]), f"{r['gen_s']:.1f}", _per_s(r["tokens_per_s"])] for r in summary["sources"]]
    rows.append(["TOTAL", t["cases"], t["passed"], t["failed"],
                 t["cases"] - t["passed"] - t["failed"], _tok(t["prompt_tokens"]), _tok(t["gen_tokens"]),
                 f"{t['gen_s']:.1f}", _per_s(t["tokens_per_s"])])
    table = tabulate(rows, headers=["source", "cases", "passed", "failed", "other", "prompt tok",
                                    "gen tok", "time s", "tok/s"], tablefmt="simple",
                     disable_numparse=True, colalign=("left",) + ("right",) * 8)
    graded = t["passed"] + t["failed"]
    pct = f"{100.0 * t['passed'] / t['cases']:.1f}%" if t["cases"] else "n/a"
    lines = [
        f"suite {summary.get('suite', '?')} | backend {summary.get('backend', '?')} | "
        f"model {summary.get('model', '?')}",
        table,
        f"passed {t['passed']}/{t['cases']} ({pct}); graded {graded}; skipped {t['skipped']}, "
        f"stopped {t['stopped']}, error {t['error']}, not run {t['pending']}",
        f"wall time {summary['wall_s']:.1f} s; generation {_tok(t['gen_tokens'])} tokens, "
        f"per-case time summed {t['gen_s']:.1f} s ({_per_s(t['tokens_per_s'])} tok/s per case), "
        f"wall-clock throughput {_per_s(t.get('wall_tokens_per_s'))} tok/s",
    ]
    if "latency" in summary:
        lines += latency_lines(summary["latency"])
    lines += [endpoint_line(e) for e in summary.get("endpoints", ())]
    if t["gen_tokens"] is None:
        lines.append(unknown_tokens_line(summary["cases"]))
    if "repeats" in summary:
        lines += _repeat_lines(summary["repeats"])
    return "\n".join(lines)


def unknown_tokens_line(cases: list[dict]) -> str:
    """Why the token totals are missing: how many cases lack counts, and what that means."""
    unknown = sum(1 for c in cases if c["gen_tokens"] is None)
    if unknown == len(cases):
        return "token counts unknown: the server sent no usage (--tokenizer GGUF counts them)"
    return (f"token totals unknown: {unknown} of {len(cases)} cases have no counts (the server sent no usage "
            f"for them; a request that failed has none; --tokenizer GGUF counts what was received)")


def case_line(st: CaseState, total: int, eta: str | None = None) -> str:
    """One finished case; `eta` (already formatted) goes into the bracketed header."""
    width = len(str(total))
    picked = "-" if st.picked is None else st.picked
    if len(picked) > 40:
        picked = picked[:37] + "..."
    head = f"[{st.number:>{width}}/{total}" + (f" eta {eta}]" if eta is not None else "]")
    if st.tokens_known:
        speed = f"{st.gen_tokens} tok {st.elapsed_s:.1f}s {_rate(st.gen_tokens, st.elapsed_s):.1f} tok/s"
    else:
        speed = f"? tok {st.elapsed_s:.1f}s"
    name = f"{st.case.source}/{st.case.id}" + (f" #{st.repeat}" if st.repeat else "")
    line = (f"{head} {st.status.value:<7} {name}  "
            f"picked={picked} expected={st.case.answer}  {speed}")
    if st.think_close not in ("none", "natural"):
        line += f"  think-close={st.think_close}"
    if st.error:
        line += f"  ({st.error})"
    return line


class PlainListener:
    """Prints one line per finished case to `stream` (default stdout), its header carrying the
    estimated time left (from the run's start, `clock` being time.monotonic)."""

    def __init__(self, total: int, stream: TextIO | None = None, clock=time.monotonic, of: int | None = None):
        self.total = total
        # What case numbers count up to: the run's own total, or (a retry) its trace's selection.
        self.of = max(of or 0, total)
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._clock = clock
        self._start: float | None = None
        self._done = 0

    def on_event(self, event: object) -> None:
        if isinstance(event, RunStarted):
            self._start = self._clock()
        if isinstance(event, CaseFinished) and event.state.status is not Status.SWITCHED:
            with self._lock:
                self._done += 1
                start = self._start if self._start is not None else self._clock()
                eta = format_clock(eta_s(self._done, self.total, self._clock() - start))
                print(case_line(event.state, self.of, eta), file=self.stream, flush=True)
