"""`ds4-eval plan`: how many cases a paired comparison needs, and what drop a suite can detect. Pure.

Contract
- `baseline_from_records(records, label) -> Baseline`: a trace's cases (the last record of
  each repeat counts, as in `repeats.group`) as per-case pass counts; `Baseline.given(P, D)`
  stands for a suite known only by its pass rate P and discordance D (`power.population_from_rates`),
  and `Baseline.overridden(P, D)` puts either over a trace's.
  With repeats the discordance is the unbiased estimate from them (`power.estimated_discordance`);
  a trace without repeats cannot show its noise, and its discordance is taken as 0 (right for
  greedy decoding of one model file) unless one is given.
- `make_plan(baseline, alpha=, power=, drop=, cases=, repeats=) -> Plan`: for the drop (a share:
  0.05 is 5 points) and the target power, the cases needed and, at `cases` (default: the
  baseline's), the smallest detectable drop and the power against `drop`, for three designs:
  one run a side (exact McNemar), `repeats` runs a side (sign test over cases of the shares of
  passing repeats; shown when repeats > 1), and the unpaired two-sample z-test TensorRT-LLM's
  accuracy suite sizes its runs with (`power.unpaired_cases`), so the saving of pairing shows.
  The model of a drop and of the noise: `ds4eval.verdict.power`.
- `render_text(plan)` and `as_json(plan)`: the plan for a terminal and for programs (numbers
  unrounded; shares, not points).
It reads no files and prints nothing (`ds4eval.cli.verdict_commands` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import power as pw
from ds4eval.verdict import repeats as rp


@dataclass(frozen=True)
class Baseline:
    """What a plan knows of BASE: per-case pass counts, or a pass rate and a discordance."""

    label: str
    population: pw.Population
    discordance: float
    discordance_note: str  # where the discordance comes from, in words
    cases: int | None      # the suite's case count (None when given as rates)
    repeats: int           # repeats of the trace (1 for given rates)

    @classmethod
    def given(cls, pass_rate: float, discordance: float) -> "Baseline":
        return cls("--pass-rate/--discordance", pw.population_from_rates(pass_rate, discordance), discordance,
                   "given", None, 1)

    def overridden(self, pass_rate: float | None, discordance: float | None) -> "Baseline":
        """This baseline with the pass rate and/or discordance given on the command line (the
        population then becomes `power.population_from_rates`'s); unchanged when neither is."""
        if pass_rate is None and discordance is None:
            return self
        rate = self.population.pass_rate if pass_rate is None else pass_rate
        disc = self.discordance if discordance is None else discordance
        note = self.discordance_note if discordance is None else "given"
        return Baseline(self.label, pw.population_from_rates(rate, disc), disc, note, self.cases, self.repeats)


def baseline_from_records(records: Iterable[TraceRecord], label: str) -> Baseline:
    cases = rp.group(records)
    counts = [(c.passed, c.graded) for c in cases if c.graded]
    if not counts:
        raise ValueError(f"{label}: no graded case to plan from")
    k = max(c.repeats for c in cases)
    estimate = pw.estimated_discordance(counts)
    if estimate is None:
        estimate, note = 0.0, "one run: assumed 0 (right for greedy decoding; give --discordance for sampled runs)"
    else:
        note = f"estimated from {k} repeats of each case"
    return Baseline(label, pw.population_from_counts(counts), estimate, note, len(counts), k)


@dataclass(frozen=True)
class DesignPlan:
    name: str
    cases_needed: int | None       # for `drop` at the target power; None beyond power.MAX_CASES
    detectable_drop: float | None  # at `Plan.cases`; None when no drop is detectable there
    power_at_cases: float          # against `drop` at `Plan.cases`


@dataclass(frozen=True)
class Plan:
    baseline: Baseline
    alpha: float
    power: float
    drop: float
    cases: int        # the case count the detectable drops are for
    repeats: int      # repeats a side of the repeated design (1: not shown)
    designs: tuple[DesignPlan, ...]


def make_plan(baseline: Baseline, *, alpha: float = 0.05, power: float = 0.8, drop: float = 0.05,
              cases: int | None = None, repeats: int | None = None) -> Plan:
    pop = baseline.population
    if not 0 < drop <= pop.pass_rate:
        raise ValueError(f"a drop of {100 * drop:g} points cannot be planned for at a pass rate of "
                         f"{100 * pop.pass_rate:.1f}%: it must be above 0 and at most the pass rate")
    n = cases or baseline.cases
    if n is None:
        raise ValueError("give --cases N: the suite size to compute the detectable drop for")
    k = repeats or baseline.repeats
    designs = []
    ks = (1, k) if k > 1 else (1,)
    for each in ks:
        design = pw.Design(pop, alpha, each, each)
        name = ("paired, one run a side (exact McNemar)" if each == 1
                else f"paired, {each} repeats a side (sign test over cases)")
        designs.append(DesignPlan(name, pw.cases_needed(design, drop, power), pw.detectable_drop(design, n, power),
                                  design.power(n, drop)))
    rate = pop.pass_rate
    designs.append(DesignPlan("unpaired two-sample z-test (TensorRT-LLM's sizing)",
                              pw.unpaired_cases(rate, drop, alpha, power),
                              pw.unpaired_detectable_drop(rate, n, alpha, power),
                              pw.unpaired_power(rate, n, drop, alpha)))
    return Plan(baseline, alpha, power, drop, n, k, tuple(designs))


# ---------------------------------------------------------------- rendering

def _points(x: float | None) -> str:
    return "none (not even losing every pass)" if x is None else f"{100 * x:.1f} points"


def render_text(plan: Plan) -> str:
    b, pop = plan.baseline, plan.baseline.population
    size = f", {b.cases} cases" if b.cases is not None else ""
    lines = [
        f"baseline: {b.label}{size}; pass rate {100 * pop.pass_rate:.1f}%, discordance {b.discordance:.3f} "
        f"({b.discordance_note})",
        f"target: detect a drop of {100 * plan.drop:g} points with power {plan.power:g} at alpha {plan.alpha:g} "
        f"(two-sided exact test; a regression needs more pass->fail than fail->pass)",
        "",
    ]
    header = ("design", f"cases for {100 * plan.drop:g} points", f"detectable at {plan.cases} cases",
              f"power at {plan.cases} cases")
    rows = [(d.name, "-" if d.cases_needed is None else f"{d.cases_needed:,}", _points(d.detectable_drop),
             f"{d.power_at_cases:.2f}") for d in plan.designs]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, tuple("-" * w for w in widths), *rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines += ["", "paired: the exact power of the test on the same cases (a drop scales every case's chance of "
                  "passing by 1 - drop / pass rate); unpaired: n = 2 P (1 - P) (z(1 - alpha/2) + z(power))^2 / drop^2 "
                  "cases per run, for scale"]
    return "\n".join(lines) + "\n"


def as_json(plan: Plan) -> dict:
    b = plan.baseline
    return {
        "format": "ds4eval-plan", "version": 1,
        "baseline": {"label": b.label, "cases": b.cases, "repeats": b.repeats,
                     "pass_rate": b.population.pass_rate, "discordance": b.discordance,
                     "discordance_source": b.discordance_note},
        "alpha": plan.alpha, "power": plan.power, "drop": plan.drop, "cases": plan.cases, "repeats": plan.repeats,
        "designs": [{"design": d.name, "cases_needed": d.cases_needed, "detectable_drop": d.detectable_drop,
                     "power_at_cases": d.power_at_cases} for d in plan.designs],
    }
