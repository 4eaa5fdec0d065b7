"""`ds4-eval gate`: a run judged against its reference's measured noise, at a planned threshold. Pure.

The threshold
- The reference ran the configuration N times; case i passed c_i of its n_i graded runs. Under
  "nothing changed", the run's passes on case i over its K repeats are predicted by the
  beta-binomial distribution BetaBinomial(K, a + c_i, b + n_i - c_i): Binomial(K, p_i) with p_i
  unknown, given the reference's counts and a Beta(a, b) prior fitted to all the reference's
  cases (`fit_prior`: the method of moments for the beta-binomial, the empirical-Bayes prior
  of "a case of this suite"). This keeps the uncertainty of the reference itself: a case that
  passed 12 of 12 reference runs is still predicted to fail now and then, as often as the
  suite's other cases suggest. (Jeffreys' Beta(1/2, 1/2) in its place pulls every never-passing
  case up to a 4% pass chance and, on the sanity suite, doubles the false alarms; the fitted
  prior held them at or below alpha in simulation.) A prior cannot be fitted from one run
  a case, nor when every case passed always or never: Jeffreys' prior is used then.
- A source's passes T = sum of its cases' passes; its predicted distribution is the convolution
  of the cases' (`predicted_total`), which takes the cases as independent. They are not quite:
  every case of a run repeat is sampled from the same seed, and some seeds send many cases
  astray at once (three of the 48 runs of the sanity reference passed 1, 1 and 2 cases, against
  a mean of 7.4). The reference measures that: its `dispersion` phi is the variance of its run
  totals over the variance the per-case model gives them. The prediction is stretched about its
  mean by sqrt(max(1, phi)) (`stretched_cdf`), so the threshold is as wide as the measured
  spread of whole runs, never narrower than the per-case model's. A variance does not see the
  shape of such shocks, so the reference's own run totals judge too: the distribution of the sum
  of K of them drawn at random (`empirical_total`, per source), and a run's p-value is the larger
  of the two (`Prediction.cdf`): the per-case model speaks for tails no reference run reached,
  the run totals for whole-run shocks the model cannot know of.
- The run fails a source when P(T <= observed) < alpha after Holm's step-down over the sources
  (one source: alpha itself). Equivalently the source fails when its passes are at or below
  the threshold t, the largest t with P(T <= t) < alpha (shown for alpha / sources, the first
  Holm step, so a source at or below it fails whatever the others do). Only drops fail: the
  test is one-sided.
- The power statement: the smallest drop of the source's pass rate that the threshold catches
  with the stated power, when every case's chance (taken as c_i / n_i) is scaled by
  1 - drop / P as in `ds4eval.verdict.power`, and the run has K repeats.

Contract
- `run_counts(records)`: per case (source, id) -> (passes, repeats due, content hash), a repeat
  not graded counting as not passed; and the run's K.
- `predict(reference, repeats) -> Prediction`: each source's predicted passes (both ways), the
  prior and the stretch; `Prediction.threshold(source, alpha)` the planned threshold.
- `judge(reference, counts, repeats, alpha=, power=) -> GateResult`: pure. A reference case
  missing from the run, or whose content hash differs, raises `GateInputError` (one line: the
  run or the reference does not fit); run cases the reference lacks are left out with a note.
- `render_text(result)` / `as_json(result)`.
It reads no files and prints nothing (`ds4eval.cli.verdict_commands` does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from ds4eval.run.trace import TraceRecord
from ds4eval.verdict import power as pw
from ds4eval.verdict import repeats as rp
from ds4eval.verdict import stats
from ds4eval.verdict.references import Reference, ReferenceCase

JEFFREYS = (0.5, 0.5)  # the prior when none can be fitted
RHO_BOUNDS = (1e-3, 0.999)  # the fitted intra-case correlation 1 / (a + b + 1) is kept inside these


class GateInputError(ValueError):
    """The run cannot be judged against the reference; the message is one line."""


def fit_prior(cases: Sequence[ReferenceCase]) -> tuple[float, float]:
    """Beta(a, b) fitted to the cases' pass shares by the beta-binomial method of moments:
    the shares' mean m and variance v, with n the mean graded count, give the correlation
    rho = (n v / (m (1 - m)) - 1) / (n - 1) = 1 / (a + b + 1); Jeffreys' prior when unfit."""
    graded = [c for c in cases if c.graded]
    n = sum(c.graded for c in graded) / len(graded) if graded else 0.0
    if len(graded) < 2 or n <= 1:
        return JEFFREYS
    rates = np.array([c.passed / c.graded for c in graded])
    m, v = float(rates.mean()), float(rates.var(ddof=1))
    if not 0.0 < m < 1.0:
        return JEFFREYS
    rho = (n * v / (m * (1 - m)) - 1) / (n - 1)
    rho = min(max(rho, RHO_BOUNDS[0]), RHO_BOUNDS[1])
    size = 1 / rho - 1
    return m * size, (1 - m) * size


def predicted_passes(passed: int, graded: int, k: int, prior: tuple[float, float] = JEFFREYS) -> np.ndarray:
    """[k + 1]: the chance that a run of k repeats passes 0..k times, for a case the reference
    saw pass `passed` of `graded` times (beta-binomial; see the module docstring)."""
    a, b = passed + prior[0], graded - passed + prior[1]
    xs = np.arange(k + 1)
    log = np.array([math.lgamma(k + 1) - math.lgamma(x + 1) - math.lgamma(k - x + 1)
                    + math.lgamma(x + a) + math.lgamma(k - x + b) - math.lgamma(k + a + b)
                    - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)) for x in xs])
    out = np.exp(log)
    return out / out.sum()


def _convolved(pmfs: Sequence[np.ndarray]) -> np.ndarray:
    total = np.ones(1)
    for p in pmfs:
        total = np.convolve(total, p)
    return total


def predicted_total(cases: Sequence[ReferenceCase], k: int, prior: tuple[float, float] = JEFFREYS) -> np.ndarray:
    """The predicted distribution of the passes of a run of k repeats over `cases`."""
    memo: dict[tuple[int, int], np.ndarray] = {}
    for c in cases:
        if (c.passed, c.graded) not in memo:
            memo[(c.passed, c.graded)] = predicted_passes(c.passed, c.graded, k, prior)
    return _convolved([memo[(c.passed, c.graded)] for c in cases])


def stretched_cdf(pmf: np.ndarray, t: float, phi: float = 1.0) -> float:
    """P(T <= t) for T distributed as `pmf` stretched about its mean m by sqrt(phi): the CDF of
    the original at m + (t + 1/2 - m) / sqrt(phi) - 1/2 (half-integer continuity correction;
    the CDF interpolated linearly between integers). phi = 1 gives the CDF itself at t."""
    cdf = np.cumsum(pmf)
    mean = float(np.dot(np.arange(pmf.size), pmf))
    x = mean + (t + 0.5 - mean) / math.sqrt(max(phi, 1.0)) - 0.5
    if x < 0:
        return 0.0 if x <= -1 else float(cdf[0] * (x + 1))
    if x >= pmf.size - 1:
        return 1.0
    lo = int(math.floor(x))
    return float(min(1.0, cdf[lo] + (cdf[lo + 1] - cdf[lo]) * (x - lo)))


def threshold(pmf: np.ndarray, alpha: float, phi: float = 1.0) -> int:
    """The largest t with P(T <= t) < alpha (the prediction stretched by phi); -1 when even no
    pass at all is that unlikely."""
    t = -1
    while t + 1 < pmf.size and stretched_cdf(pmf, t + 1, phi) < alpha:
        t += 1
    return t


def _caught(cases: Sequence[ReferenceCase], k: int, t: int, drop: float, rate: float, phi: float) -> float:
    """P(T <= t) when every case's chance c / n is scaled by 1 - drop / rate (spread by phi too)."""
    if t < 0:
        return 0.0
    scale = max(0.0, 1.0 - drop / rate)
    pmfs = []
    for c in cases:
        p = min(1.0, scale * c.passed / c.graded) if c.graded else 0.0
        xs = np.arange(k + 1)
        pmfs.append(np.array([math.comb(k, x) * p ** x * (1 - p) ** (k - x) for x in xs]))
    return stretched_cdf(_convolved(pmfs), t, phi)


def detectable_drop(cases: Sequence[ReferenceCase], k: int, t: int, power: float, phi: float = 1.0) -> float | None:
    """The smallest drop of the pass rate a run of k repeats fails with chance `power` at threshold t."""
    graded = [c for c in cases if c.graded]
    rate = sum(c.passed / c.graded for c in graded) / len(graded) if graded else 0.0
    if rate <= 0 or _caught(graded, k, t, rate, rate, phi) < power:
        return None
    lo, hi = 0.0, rate
    while hi - lo > pw.DROP_TOLERANCE:
        mid = (lo + hi) / 2
        if _caught(graded, k, t, mid, rate, phi) >= power:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class SourceGate:
    source: str
    cases: int
    expected: float          # mean predicted passes of the run
    observed: int            # the run's passes
    p: float                 # P(T <= observed) under "nothing changed"
    adjusted: float          # Holm-adjusted over the sources
    threshold: int           # fails at or below this many passes (at alpha / sources)
    detectable_drop: float | None
    failed: bool


@dataclass(frozen=True)
class GateResult:
    reference: Reference
    repeats: int
    alpha: float
    power: float
    sources: tuple[SourceGate, ...]
    notes: tuple[str, ...]
    prior: tuple[float, float]  # the Beta prior the predictions use (fit_prior)
    dispersion: float | None  # observed variance of the reference's run totals / the per-case model's

    @property
    def failed(self) -> bool:
        return any(s.failed for s in self.sources)

    @property
    def exit_status(self) -> int:
        return 1 if self.failed else 0


def run_counts(records: Sequence[TraceRecord]) -> tuple[dict[tuple[str, str], tuple[int, int, str]], int]:
    groups = rp.group(records)
    k = max((g.repeats for g in groups), default=1)
    counts = {(g.source, g.id): (g.passed, k, g.records[0].case_hash) for g in groups}
    return counts, k


def judge(reference: Reference, counts: dict[tuple[str, str], tuple[int, int, str]], repeats: int, *,
          alpha: float = 0.01, power: float = 0.8) -> GateResult:
    missing = [c.name for c in reference.cases if (c.source, c.id) not in counts]
    if missing:
        raise GateInputError(f"the run lacks {len(missing)} of the reference's {len(reference.cases)} cases "
                             f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}): run the whole suite")
    stale = [c.name for c in reference.cases if counts[(c.source, c.id)][2] != c.case_hash]
    if stale:
        raise GateInputError(f"{len(stale)} case(s) changed content since the reference was recorded "
                             f"({', '.join(stale[:5])}): record the reference again")
    known = {(c.source, c.id) for c in reference.cases}
    extra = [f"{s}/{i}" for s, i in counts if (s, i) not in known]
    notes = [f"{len(extra)} case(s) of the run are not in the reference and are left out"] if extra else []
    pred = predict(reference, repeats)
    m = len(pred.sources)
    rows = []
    for source, cases in pred.sources.items():
        pmf = pred.totals[source]
        observed = sum(counts[(c.source, c.id)][0] for c in cases)
        t = pred.threshold(source, alpha / m)
        rows.append((source, cases, float(np.dot(np.arange(pmf.size), pmf)), observed,
                     pred.cdf(source, observed), t, detectable_drop(cases, repeats, t, power, pred.phi)))
    holm = stats.holm([r[4] for r in rows], alpha)
    sources = tuple(SourceGate(src, len(cases), exp, obs, p, h.adjusted, t, drop, h.rejected)
                    for (src, cases, exp, obs, p, t, drop), h in zip(rows, holm))
    return GateResult(reference, repeats, alpha, power, sources, tuple(notes), pred.prior, pred.dispersion)


@dataclass(frozen=True)
class Prediction:
    """What the reference predicts for a run of `repeats` repeats of an unchanged system."""

    sources: dict[str, list[ReferenceCase]]
    totals: dict[str, np.ndarray]  # source -> the per-case model's distribution of its passes (unstretched)
    runs: dict[str, np.ndarray]    # source -> the distribution of the sum of `repeats` reference run totals
    prior: tuple[float, float]
    dispersion: float | None
    phi: float  # the stretch applied: max(1, dispersion)

    def cdf(self, source: str, t: int) -> float:
        """P(passes <= t) under "nothing changed": the larger of the stretched model's and the
        reference run totals' (see the module docstring)."""
        runs = self.runs[source]
        empirical = float(np.cumsum(runs)[min(t, runs.size - 1)]) if t >= 0 else 0.0
        return max(stretched_cdf(self.totals[source], t, self.phi), empirical)

    def threshold(self, source: str, alpha: float) -> int:
        """The largest t with cdf(t) < alpha; -1 when there is none."""
        t = -1
        while t + 1 < self.totals[source].size and self.cdf(source, t + 1) < alpha:
            t += 1
        return t


def empirical_total(run_passes: Sequence[int], k: int) -> np.ndarray:
    """The distribution of the sum of k values drawn with replacement from `run_passes`."""
    one = np.bincount(np.asarray(run_passes, dtype=int)) / len(run_passes)
    return _convolved([one] * k)


def predict(reference: Reference, repeats: int) -> Prediction:
    by_source: dict[str, list[ReferenceCase]] = {}
    for c in reference.cases:
        by_source.setdefault(c.source, []).append(c)
    prior = fit_prior(reference.cases)
    spread = dispersion(reference)
    totals = {src: predicted_total(cases, repeats, prior) for src, cases in by_source.items()}
    runs = {src: empirical_total(reference.run_passed_by_source[src], repeats) for src in by_source}
    return Prediction(by_source, totals, runs, prior, spread, max(1.0, spread or 1.0))


def dispersion(reference: Reference) -> float | None:
    """How much more the reference's run totals spread than independent cases would make them:
    their sample variance over the sum of the cases' unbiased c (n - c) / (n (n - 1)). Near 1
    when cases are independent within a run; above 1 when something moves a whole run (a seed
    shared by its cases), and the gate's prediction is widened by it. None under 3 runs."""
    if reference.runs < 3:
        return None
    totals = np.array(reference.run_passed, dtype=float)
    model = sum(c.passed * (c.graded - c.passed) / (c.graded * (c.graded - 1)) for c in reference.cases
                if c.graded > 1)
    return float(totals.var(ddof=1) / model) if model > 0 else None


# ---------------------------------------------------------------- rendering

def _spread(values: Sequence[int]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return f"mean {mean:.1f}, sd {sd:.1f}, range {min(values)}-{max(values)}"


def render_text(result: GateResult) -> str:
    ref = result.reference
    runs = "run" if result.repeats == 1 else f"run of {result.repeats} repeats"
    lines = [f"reference: {ref.key.describe()}",
             f"reference runs: {ref.runs}; passes per run {_spread(ref.run_passed)} of {ref.run_graded[0]}",
             f"gate: one-sided at alpha {result.alpha:g} (Holm over {len(result.sources)} source(s)); "
             f"a {runs} is predicted from each case's reference counts (beta-binomial, prior "
             f"Beta({result.prior[0]:.3g}, {result.prior[1]:.3g}) fitted to the reference's cases)"]
    if result.dispersion is not None:
        lines.append(f"reference run totals spread {result.dispersion:.2f}x the variance independent cases give; "
                     f"the prediction is widened by {max(1.0, result.dispersion):.2f}x")
    for s in result.sources:
        verdict = "FAILED" if s.failed else "ok"
        drop = ("no drop is caught" if s.detectable_drop is None else
                f"a drop of {100 * s.detectable_drop:.1f} points is caught with probability {result.power:g}")
        lines.append(f"{s.source}: {s.observed} passes of {s.cases * result.repeats} (expected {s.expected:.1f}; "
                     f"fails at {s.threshold} or fewer); P(this few or fewer | unchanged) = {s.p:.3g}, "
                     f"Holm {s.adjusted:.3g}: {verdict}; {drop}")
    lines += [f"note: {n}" for n in result.notes]
    failed = [s.source for s in result.sources if s.failed]
    lines.append(f"gate: FAILED ({', '.join(failed)} below the reference's noise)" if failed
                 else "gate: ok (within the reference's noise)")
    return "\n".join(lines) + "\n"


def as_json(result: GateResult) -> dict:
    ref = result.reference
    return {"format": "ds4eval-gate", "version": 1, "key": asdict(ref.key), "reference_runs": ref.runs,
            "reference_run_passed": list(ref.run_passed), "repeats": result.repeats, "alpha": result.alpha,
            "power": result.power, "failed": result.failed, "exit_status": result.exit_status,
            "sources": [{"source": s.source, "cases": s.cases, "expected": s.expected, "observed": s.observed,
                         "p": s.p, "holm_p": s.adjusted, "threshold": s.threshold,
                         "detectable_drop": s.detectable_drop, "failed": s.failed} for s in result.sources],
            "prior": list(result.prior), "dispersion": result.dispersion, "notes": list(result.notes)}
