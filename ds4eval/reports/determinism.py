"""The documents of a determinism run and of a comparison's noise note. Pure.

Contract
- `document(result) -> Document`: the verdict line (invariant, or which conditions vary), the
  table of conditions (verdict, prompts, how many varied and how: near-tie, real, unknown; the
  most distinct completions of one prompt; failed requests), every divergence (prompt,
  condition, distinct completions, the first differing token or word with both sides and the
  reference's top-2 gap), the settings and the stack, and the run's notes. The same document
  renders as text, markdown and the HTML page (`render(result, fmt)`); "json" is the result
  file itself (`Result.to_json`).
- `noise_section(explanation, result) -> Section`: the compare report's section that says how
  many of its flips the stack's own non-determinism explains.
It computes nothing: every figure comes from the Result or the NoiseExplanation.
"""

from __future__ import annotations

from typing import Callable

from ds4eval.determinism.analysis import NoiseExplanation, Result
from ds4eval.reports import html, markdown, text
from ds4eval.reports.document import Cell, Document, Section, Table, Text, row

CONDITION_COLUMNS = ("condition", "verdict", "prompts", "varied", "near-tie", "real", "unknown", "max distinct",
                     "failed")
DIVERGENCE_COLUMNS = ("prompt", "condition", "distinct", "parts at", "reference", "other", "which", "top-2 gap",
                      "class")


def _gap(gap: float | None) -> str:
    return "-" if gap is None else f"{gap:.4f}"


def verdict_line(result: Result) -> str:
    varying = [v.condition for v in result.verdicts if v.verdict == "varies"]
    incomplete = [v.condition for v in result.verdicts if v.verdict == "incomplete"]
    if result.invariant:
        return f"INVARIANT: one completion per prompt under every condition ({len(result.verdicts)} conditions)"
    parts = []
    if varying:
        parts.append(f"varies under {', '.join(varying)}")
    if incomplete:
        parts.append(f"incomplete under {', '.join(incomplete)} (failed requests)")
    return "NOT INVARIANT: " + "; ".join(parts)


def conditions_table(result: Result) -> Table:
    return Table(CONDITION_COLUMNS, tuple(
        row(v.condition, Cell(v.verdict, style="status", tag="PASS" if v.invariant else "FAIL"), v.prompts,
            v.varying, v.near_tie, v.real, v.unknown, v.max_distinct, v.failed)
        for v in result.verdicts), key="conditions")


def divergences_table(result: Result) -> Table:
    rows = []
    for o in result.outcomes:
        d = o.divergence
        if d is None:
            continue
        rows.append(row(o.prompt, o.condition, o.distinct, f"{o.unit} {d.index}", Cell(repr(d.reference), style="code"),
                        Cell(repr(d.other), style="code"), d.other_label, _gap(d.gap), d.klass))
    return Table(DIVERGENCE_COLUMNS, tuple(rows), key="divergences", style="sortable")


def settings_table(result: Result) -> Table:
    items = [*(("stack " + k, v) for k, v in result.stack.items()),
             *((k, ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)) for k, v in result.settings.items()),
             ("elapsed", f"{result.elapsed_s:.1f} s")]
    return Table(("field", "value"), tuple(row(k, v) for k, v in items), key="settings", style="kv")


def document(result: Result) -> Document:
    sections = [Section("Conditions", (conditions_table(result),), key="conditions-section")]
    div = divergences_table(result)
    sections.append(Section("Divergences", (div,) if div.rows else (Text(("No prompt's completion varied.",)),),
                            key="divergences-section"))
    errors = [e for o in result.outcomes for e in o.errors]
    if errors:
        sections.append(Section("Failed requests", (Text(tuple(errors[:50]) + (
            (f"... and {len(errors) - 50} more",) if len(errors) > 50 else ())),)))
    if result.notes:
        sections.append(Section("Notes", (Text(result.notes, note=True),)))
    sections.append(Section("Settings", (settings_table(result),), key="settings-section"))
    lead = Cell(verdict_line(result), style="verdict", tag="good" if result.invariant else "bad")
    return Document("ds4-eval determinism", tuple(sections), lead)


RENDERERS: dict[str, Callable[[Result], str]] = {
    "text": lambda r: text.render(document(r)),
    "markdown": lambda r: markdown.render(document(r), markdown.escaped_table),
    "html": lambda r: html.render(document(r)),
    "json": Result.to_json,
}
"""Each format's renderer; a new format is one entry."""


def render(result: Result, fmt: str) -> str:
    return RENDERERS[fmt](result)


def noise_lines(e: NoiseExplanation, result: Result) -> tuple[str, ...]:
    stack = result.stack.get("url") or result.stack.get("model") or "the stack"
    share = f"{e.varying_share:.0%} of the prompts it measured varied under some condition"
    if e.method == "by case":
        lines = [f"{e.explained} of {e.flips} flipped cases are cases whose output varies on {stack} by itself "
                 f"({share}); the other {e.flips - e.explained} flips are not explained by its noise."]
        if e.measured < e.flips:
            lines.append(f"{e.flips - e.measured} flipped cases were not measured by the determinism run.")
    else:
        lines = [f"The determinism run measured other prompts ({share} on {stack}): at that rate its noise "
                 f"changes about {e.explained} of the {e.compared} compared cases' outputs (95% upper bound "
                 f"{e.upper}); at least {max(0, e.unexplained)} of the {e.flips} flips are not explained by it."]
    if result.invariant:
        lines = [f"The stack was invariant under every measured condition ({stack}): none of the {e.flips} "
                 f"flips comes from its own non-determinism."]
    return tuple(lines)


def noise_section(e: NoiseExplanation, result: Result) -> Section:
    return Section("Stack noise", (Text(noise_lines(e, result)), conditions_table(result)), key="noise")
