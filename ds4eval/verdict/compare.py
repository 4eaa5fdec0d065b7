"""Comparing two runs case by case: the regression verdict behind `ds4-eval compare BASE NEW`.

Contract
- `read_run(text, label) -> Run` reads a trace (`traces/README.md`) or a JSON summary that
  holds per-case verdicts (`report.build_summary`); anything else raises `CompareInputError`
  with a one-line message. A case recorded more than once (retries append) counts by its last
  record. Traces from before statuses were recorded are graded from their own outputs and keys.
  A Run keeps every record of its trace (`Run.records`; none for a summary), so reports that
  show questions and outputs take them from the Comparison and no trace is parsed twice.
- `compare(base, new, alpha=, strict=, allow=) -> Comparison` is pure. Cases are matched by
  (source, id) and must carry the same content hash (else, in older traces, the same answer
  key). A matched case stays out of the verdict, with a warning, when it is graded on one side
  only, its pin differs, or, unless `allow` names the difference as the change under test, it
  ran on a different model (model file SHA-256 when both sides know it, so one file served
  under two names is one model; else model name), with a different prompt (the
  rendered prompt's token hash, else the prompt texts), or with different sampling settings
  (greedy runs compare as greedy whatever their top-p, min-p and seed). Cases present on one
  side only are warned about too. Other differences in provenance (KV cache type, budget,
  backend, extractor or ds4eval version, concurrency: a serial run against one under load...)
  are listed as notes: they are what the comparison is usually about.
- On the comparable cases: passed/graded per source and in total, the paired bootstrap
  interval of the pass-rate delta and the exact McNemar test (`stats`), every flip (a flip to
  "no answer found" counted apart from a wrong answer), token/time/tokens-per-second deltas and
  the largest changes in generated length. Token counts follow each run's recorded rule
  (`gen_tokens_eos`, `TokenCounting`): when one side counts the end-of-sequence token that ends
  a reply and the other does not, the counting side's counts are taken without it (one less for
  each case that ended before its budget) and a warning says so; when only one side's rule is
  known, the warning says the deltas may be off by one per case. When prompt hashes differ, `render_diffs` locate the
  first differing token and keep a few tokens of text around it on both sides.
- Verdict, on all comparable cases together: exit status 1 for a significant regression
  (McNemar exact p < alpha with more pass->fail than fail->pass flips) or, with `strict`, any
  pass->fail flip or lost pass (a case that passed in BASE and has no verdict in NEW, or is
  missing from it); else 0. Nothing comparable at all raises `CompareInputError` (the CLI's
  exit status 2).
- Repeated runs (`--repeats K`, either side): each case's first repeat stands for it in the
  provenance checks and the repeat-0 tables, and the verdict moves to the pass counts
  (`RepeatComparison`): a sign test over cases (how many passed less often against more often;
  with one repeat a side it is McNemar's test) decides a significant regression, each case gets
  Fisher's exact test on its k/K counts, and `--strict` fails on any significant per-case drop.
  A case flaky on BASE that passes less often on NEW without a significant drop is listed apart,
  not counted as a regression; cases that became or stopped being flaky are listed too.
- What the verdict could see (`Assurance`, beside the p-value): the smallest drop the test
  would have called a significant regression with chance `power` (default 0.8) at this many
  comparable cases and this noise (`power.detectable_drop`; the noise is the observed share of
  discordant cases with one run a side, BASE's per-case pass shares with repeats), so that "no
  significant regression" is never read as "no regression". With several sources, each
  source's test (McNemar, or the sign test with repeats) and Holm's step-down adjustment over
  them: which sources regressed significantly with the family-wise error held at alpha (stated,
  not part of the exit status). With `equivalence=MARGIN` (a share), the two one-sided tests
  of "the pass rate moved by less than MARGIN either way" (`stats.paired_equivalence`; with
  repeats, on the expected table of one repeat a side per case, which keeps the repeats' mean
  change and overstates its variance: conservative), and the exit status is then 1 unless
  equivalence is shown (as well as for a regression).
- `collector_paused()`: a context that pauses Python's cyclic garbage collector (reading and
  pairing build about a million acyclic objects for two 10,000-case traces); `read_run` and
  `compare` use it, and so does the CLI around the whole command.
- `compare` runs in four phases, one function each: `_match` (pair the cases, find why each
  would stay out), `_warnings`, `_statistics` (on the comparable cases) and `_verdict`.
It reads no files and prints nothing: `ds4eval.reports` builds and renders a Comparison's reports.
"""

from __future__ import annotations

import gc
import heapq
import json
from contextlib import contextmanager
from collections import Counter
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Sequence

import pandas as pd

from ds4eval.config import ALLOWED_DIFFS
from ds4eval.run.provenance import split_tokens
from ds4eval.run.trace import ParsedTrace, TraceRecord, parse_trace
from ds4eval.verdict import power as pw
from ds4eval.verdict import regrade
from ds4eval.verdict import repeats
from ds4eval.verdict import stats

GRADED = ("PASSED", "FAILED")
# Provenance and settings whose differences are reported as notes, never excluded.
NOTE_FIELDS = ("backend", "endpoint", "served_model", "device", "kv_type", "max_tokens", "tokens", "thinking",
               "chat_template_sha256", "bos_eos", "extractor_version", "ds4eval_version", "git_commit",
               "concurrency", "gen_tokens_eos")
CONTEXT_TOKENS = 4  # tokens of text shown on each side of a render difference
LISTED_CASES = 8  # case names listed in one warning before "and N more"


class CompareInputError(ValueError):
    """The input cannot be compared; the message is one line."""


# ---------------------------------------------------------------- one side

@dataclass(slots=True)
class CaseRun:
    """One case as one run recorded it (not frozen: a frozen dataclass is several times slower
    to build, and a comparison builds one per case and side)."""

    source: str
    id: str
    status: str  # PASSED, FAILED, SKIPPED, STOPPED, ERROR, or "" when unknown
    picked: str | None
    expected: str
    key: tuple  # the answer key as the run saw it (kind, expected, aliases, options): the pin of old traces
    case_hash: str
    model: str
    model_sha256: str
    sampling: tuple
    prompt_sha256: str
    prompt_text: str  # system and question prompt; "" when the run did not record them
    rendered_prompt: str  # the prompt the model saw and where each of its tokens ends ("" if unknown)
    rendered_token_ends: str
    prompt_tokens: int
    gen_tokens: int
    elapsed_s: float
    settings: tuple[str, ...]  # one value per NOTE_FIELDS entry, "" when unknown

    @property
    def name(self) -> str:
        return f"{self.source}/{self.id}"

    @property
    def graded(self) -> bool:
        return self.status in GRADED

    @property
    def passed(self) -> bool:
        return self.status == "PASSED"

    @property
    def no_answer(self) -> bool:
        return not self.picked

    def setting(self, name: str) -> str:
        return self.settings[NOTE_FIELDS.index(name)]

    @property
    def ended_by_eos(self) -> bool:
        """Whether the generation ended before its budget (so by an end-of-sequence token: ds4-eval
        sends no stop sequences); False when the budget is unknown."""
        budget = self.setting("max_tokens")
        return bool(budget) and 0 < self.gen_tokens < int(budget)

    def prompt_tokens_text(self) -> list[str]:
        return split_tokens(self.rendered_prompt, self.rendered_token_ends)


@dataclass
class Run:
    label: str
    kind: str  # "trace" or "summary"
    cases: dict[tuple[str, str], CaseRun]
    repeated: int = 0  # cases recorded more than once (the last record counts)
    problems: list[str] = field(default_factory=list)
    suite: str = ""
    repeats: int = 1  # --repeats K of the run: the most repeats any case has
    tallies: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # case -> (passed, graded repeats)
    # Every record of the trace as parsed (retries and repeats included), for reports that show
    # questions and outputs; none for a summary, which holds verdicts only.
    records: tuple[TraceRecord, ...] = ()


def sampling_key(temperature: float, top_p: float, min_p: float, seed: int | None) -> tuple:
    """Settings that change what a sampler draws; greedy decoding ignores all but temperature."""
    if not temperature:
        return ("greedy",)
    return ("sampled", float(temperature), float(top_p), float(min_p), seed)


# A trace record's NOTE_FIELDS, in order (max_tokens, tokens and thinking are built in between,
# concurrency and gen_tokens_eos after).
_RUN_SETTINGS = attrgetter("backend", "endpoint", "served_model", "device", "kv_type")
_RUN_PROVENANCE = attrgetter("chat_template_sha256", "bos_eos", "extractor_version", "ds4eval_version", "git_commit")


def _record_case(r: TraceRecord) -> CaseRun:
    status, picked = r.status or "", r.picked
    if r.status is None:  # a trace from before statuses: grade it from its own output and key
        rep = regrade.regrade([r])
        if rep.cases:
            status, picked = rep.cases[0].new_status, rep.cases[0].new_picked
    settings = (*_RUN_SETTINGS(r), str(r.max_tokens or ""), "", "yes" if r.thinking else "no", *_RUN_PROVENANCE(r),
                str(r.concurrency or ""), r.gen_tokens_eos)
    return CaseRun(
        source=r.source, id=r.id, status=status, picked=picked, expected=r.expected,
        key=(r.answer_kind, r.expected, tuple(r.aliases), r.nchoices),
        case_hash=r.case_hash, model=r.model, model_sha256=r.model_sha256,
        sampling=sampling_key(r.temperature, r.top_p, r.min_p, r.seed), prompt_sha256=r.prompt_sha256,
        prompt_text=r.system_prompt + "\n" + r.question_prompt if (r.system_prompt or r.question_prompt) else "",
        rendered_prompt=r.rendered_prompt, rendered_token_ends=r.rendered_token_ends,
        prompt_tokens=r.prompt_tokens, gen_tokens=r.gen_tokens,
        elapsed_s=r.elapsed_s, settings=settings)


def _summary_cases(obj: dict, label: str) -> list[CaseRun]:
    rows = obj.get("cases")
    if not isinstance(rows, list) or not rows:
        raise CompareInputError(f"{label}: the summary holds no per-case verdicts")
    prov = obj.get("provenance") if isinstance(obj.get("provenance"), dict) else {}
    st = obj.get("settings") if isinstance(obj.get("settings"), dict) else {}
    try:
        sampling = sampling_key(float(st.get("temperature") or 0.0), float(st.get("top_p", 1.0)),
                                float(st.get("min_p") or 0.0), st.get("seed"))
    except (TypeError, ValueError):
        raise CompareInputError(f"{label}: the summary's sampling settings are not numbers") from None
    values = {k: str(prov.get(k) or "") for k in NOTE_FIELDS if k in prov}
    values.update(backend=str(obj.get("backend") or ""), tokens=str(st.get("tokens") or ""),
                  concurrency=str(st.get("concurrency") or ""),
                  thinking={True: "yes", False: "no"}.get(st.get("think"), ""))
    settings = tuple(values.get(k, "") for k in NOTE_FIELDS)
    out = []
    for i, c in enumerate(rows):
        if not isinstance(c, dict) or not isinstance(c.get("source"), str) or not isinstance(c.get("id"), str) \
                or not isinstance(c.get("status"), str):
            raise CompareInputError(f"{label}: summary case {i + 1} lacks source, id or status")
        try:
            out.append(CaseRun(
                source=c["source"], id=c["id"], status=c["status"], picked=c.get("picked"),
                expected=str(c.get("expected") or ""), key=(str(c.get("expected") or ""),),
                case_hash=str(c.get("case_hash") or ""), model=str(obj.get("model") or ""),
                model_sha256=str(prov.get("model_sha256") or ""), sampling=sampling,
                prompt_sha256=str(c.get("prompt_sha256") or ""), prompt_text="", rendered_prompt="",
                rendered_token_ends="",
                prompt_tokens=int(c.get("prompt_tokens") or 0), gen_tokens=int(c.get("gen_tokens") or 0),
                elapsed_s=float(c.get("elapsed_s") or 0.0), settings=settings))
        except (TypeError, ValueError):
            raise CompareInputError(f"{label}: summary case {i + 1} has a count that is not a number") from None
    return out


@contextmanager
def collector_paused():
    """Reading a trace and pairing its cases build tens of thousands of objects in a burst, none
    of them in a reference cycle; the cyclic collector would scan them over and over as they pile
    up (a fifth of the time of comparing two 10,000-case traces). Restored on the way out."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_run(text: str, label: str) -> Run:
    """A trace or a JSON summary (see the module docstring)."""
    with collector_paused():
        return _read_run(text, label)


def _read_run(text: str, label: str) -> Run:
    if not text.lstrip().startswith("{"):
        return _trace_run(parse_trace(text), label)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CompareInputError(f"{label}: not a ds4-eval summary (invalid JSON: {e.msg})") from None
    if not isinstance(obj, dict) or obj.get("format") != "ds4eval-summary":
        raise CompareInputError(f"{label}: JSON that is not a ds4-eval summary")
    return _run_of(_summary_cases(obj, label), label, "summary", [], str(obj.get("suite") or ""), ())


def trace_run(parsed: ParsedTrace, label: str) -> Run:
    """The run of an already parsed trace (e.g. shard traces merged by ds4eval.run.merge)."""
    with collector_paused():
        return _trace_run(parsed, label)


def _trace_run(parsed: ParsedTrace, label: str) -> Run:
    if not parsed.records:
        why = f" ({parsed.problems[0]})" if parsed.problems else " (no case blocks)"
        raise CompareInputError(f"{label}: not a ds4-eval trace{why}")
    if any(r.repeat for r in parsed.records):
        return _repeated_run(parsed.records, label, list(parsed.problems))
    found = [_record_case(r) for r in parsed.records]
    return _run_of(found, label, "trace", list(parsed.problems), parsed.records[-1].suite, tuple(parsed.records))


def _run_of(found: list, label: str, kind: str, problems: list[str], suite: str,
            records: tuple[TraceRecord, ...]) -> Run:
    cases: dict[tuple[str, str], CaseRun] = {}
    for c in found:
        cases[(c.source, c.id)] = c
    return Run(label, kind, cases, repeated=len(found) - len(cases), problems=problems, suite=suite, records=records)


def _repeated_run(records: list[TraceRecord], label: str, problems: list[str]) -> Run:
    """A trace of --repeats K: each case's first repeat stands for it in the per-record tables
    (provenance, flips of repeat 0), and its pass count over all repeats goes to `tallies`."""
    grouped = repeats.group(records)
    cases, tallies = {}, {}
    for g in grouped:
        first = _record_case(g.records[0])
        cases[(g.source, g.id)] = first
        tallies[(g.source, g.id)] = (g.passed, g.graded)
    kept = sum(len(g.records) for g in grouped)
    return Run(label, "trace", cases, repeated=len(records) - kept, problems=problems, suite=records[-1].suite,
               repeats=max(g.repeats for g in grouped), tallies=tallies, records=tuple(records))


# ---------------------------------------------------------------- the comparison

@dataclass(frozen=True)
class Flip:
    source: str
    id: str
    direction: str  # "pass->fail" or "fail->pass"
    base_picked: str | None
    new_picked: str | None
    base_expected: str
    new_expected: str
    no_answer: bool  # the failing side found no answer

    @property
    def name(self) -> str:
        return f"{self.source}/{self.id}"


@dataclass(frozen=True)
class SourceStats:
    """Comparable cases of one source (or of all: source "TOTAL")."""

    source: str
    cases: int
    base_passed: int
    new_passed: int
    pass_fail: int
    fail_pass: int
    pass_fail_no_answer: int  # pass->fail flips where NEW found no answer
    fail_pass_no_answer: int  # fail->pass flips where BASE had found no answer
    base_no_answer: int
    new_no_answer: int
    interval: stats.Interval
    test: stats.McNemar
    base_gen_tokens: int
    new_gen_tokens: int
    base_gen_s: float
    new_gen_s: float
    base_prompt_tokens: int
    new_prompt_tokens: int

    @property
    def base_rate(self) -> float:
        return self.base_passed / self.cases

    @property
    def new_rate(self) -> float:
        return self.new_passed / self.cases

    @property
    def delta(self) -> float:
        return self.interval.delta

    @property
    def base_tok_s(self) -> float:
        return self.base_gen_tokens / self.base_gen_s if self.base_gen_s > 0 else 0.0

    @property
    def new_tok_s(self) -> float:
        return self.new_gen_tokens / self.new_gen_s if self.new_gen_s > 0 else 0.0


@dataclass(frozen=True)
class LengthChange:
    source: str
    id: str
    base_gen_tokens: int
    new_gen_tokens: int
    base_status: str
    new_status: str

    @property
    def delta(self) -> int:
        return self.new_gen_tokens - self.base_gen_tokens


@dataclass(frozen=True)
class TokenCounting:
    """How the two runs count generated tokens (`gen_tokens_eos`: "yes" counts the end-of-sequence
    token that ends a reply, "no" does not, "" unknown) and what the comparison does about it:
    when both rules are known and differ, the counting side's counts are taken without that token
    (`counted`), so that token deltas compare like with like."""

    base: str = ""
    new: str = ""

    @property
    def aligned(self) -> bool:
        return {self.base, self.new} == {"yes", "no"}

    def counted(self, c: CaseRun) -> int:
        """`c`'s generated tokens under the rule both sides share."""
        if self.aligned and c.setting("gen_tokens_eos") == "yes" and c.ended_by_eos:
            return c.gen_tokens - 1
        return c.gen_tokens

    def note(self, pairs: Sequence[tuple[CaseRun, CaseRun]]) -> Issue | None:
        """A warning saying how the rules differ, or None when they do not (or neither is known)."""
        rule = {"yes": "counts the end-of-sequence token that ends a reply", "no": "does not count the "
                "end-of-sequence token that ends a reply", "": "does not say whether it counts the "
                "end-of-sequence token that ends a reply"}
        if self.base == self.new or not (self.base or self.new):
            return None
        text = f"token counts follow different rules: BASE {rule[self.base]}, NEW {rule[self.new]}"
        if self.aligned:
            side, pick = ("BASE", 0) if self.base == "yes" else ("NEW", 1)
            ended = sum(1 for p in pairs if p[pick].ended_by_eos)
            text += (f"; {side}'s counts are taken without it (one token less for each of its {ended} matched "
                     f"case(s) that ended before their budget)")
        else:
            text += "; the token deltas may be off by one for each case that ended before its budget"
        return Issue("tokens", text, excluded=False)


def token_counting(pairs: Sequence[tuple[CaseRun, CaseRun]]) -> TokenCounting:
    """The two runs' counting rules, from their first matched case (a run-level field)."""
    if not pairs:
        return TokenCounting()
    b, n = pairs[0]
    return TokenCounting(b.setting("gen_tokens_eos"), n.setting("gen_tokens_eos"))


@dataclass(frozen=True)
class Issue:
    """A warning: cases that are out of the verdict, or something that weakens it."""

    kind: str  # only_base, only_new, pin, model, prompt, sampling, ungraded, repeated, trace, provenance
    message: str
    cases: tuple[str, ...] = ()
    excluded: bool = True


@dataclass(frozen=True)
class Difference:
    """A setting or provenance field that differs between matched cases (a note)."""

    field: str
    base: str
    new: str
    cases: int


@dataclass(frozen=True)
class RenderDiff:
    """Where the rendered prompts of one or more cases first differ."""

    cases: tuple[str, ...]
    position: int | None  # first differing token; None when the token texts cannot show it
    base_tokens: int
    new_tokens: int
    context_start: int
    base_context: tuple[str, ...]
    new_context: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class RepeatCase:
    """One comparable case's pass counts over its repeats on both sides."""

    source: str
    id: str
    base_passed: int
    base_graded: int
    new_passed: int
    new_graded: int
    p_drop: float  # Fisher's exact test, one-sided: NEW's pass share is lower than BASE's
    p_rise: float  # ... higher

    @property
    def name(self) -> str:
        return f"{self.source}/{self.id}"

    @property
    def base_rate(self) -> float:
        return self.base_passed / self.base_graded if self.base_graded else 0.0

    @property
    def new_rate(self) -> float:
        return self.new_passed / self.new_graded if self.new_graded else 0.0

    @property
    def base_class(self) -> str:
        return repeats.klass(self.base_passed, self.base_graded)

    @property
    def new_class(self) -> str:
        return repeats.klass(self.new_passed, self.new_graded)

    @property
    def p(self) -> float:
        """Fisher's one-sided p in the direction the pass share moved (the smaller of the two:
        the test against the move seen is never the smaller one); with no move, still the smaller."""
        return min(self.p_drop, self.p_rise)


@dataclass(frozen=True)
class RepeatComparison:
    """The verdict's basis when either run has repeats: every comparable case's k of K."""

    base_repeats: int
    new_repeats: int
    cases: tuple[RepeatCase, ...]
    base_pass_at_1: float  # mean over cases of the share of passing repeats
    new_pass_at_1: float
    interval: stats.MeanInterval  # bootstrap interval of the mean per-case change (NEW - BASE)
    test: stats.McNemar  # sign test: b = cases whose share fell, c = cases whose share rose
    drops: tuple[RepeatCase, ...]          # significant per-case drops (Fisher p_drop < alpha)
    rises: tuple[RepeatCase, ...]          # significant per-case rises
    flaky_drops: tuple[RepeatCase, ...]    # flaky on BASE, lower on NEW, not significantly
    became_flaky: tuple[RepeatCase, ...]   # stable on BASE, flaky on NEW
    stopped_flaky: tuple[RepeatCase, ...]  # flaky on BASE, stable on NEW

    def change(self, r: RepeatCase) -> str:
        """What happened to case `r`, in words: "regressed" / "improved" (a significant drop or
        rise), "became flaky" / "stopped being flaky", "lower" / "higher" (a move that is
        neither), joined by ", " when several hold; "" when its pass share did not move."""
        words = ["regressed"] if r in self.drops else ["improved"] if r in self.rises else []
        if r in self.became_flaky:
            words.append("became flaky")
        elif r in self.stopped_flaky:
            words.append("stopped being flaky")
        if not words and r.new_rate != r.base_rate:
            words.append("lower" if r.new_rate < r.base_rate else "higher")
        return ", ".join(words)

    def ranked(self) -> list[RepeatCase]:
        """Every case, the smallest Fisher p first (ties: the larger move, then by name)."""
        return sorted(self.cases, key=lambda r: (r.p, -abs(r.new_rate - r.base_rate), r.name))


def _repeat_comparison(comparable: list[tuple[CaseRun, CaseRun]], base: Run, new: Run, alpha: float,
                       resamples: int, seed: int) -> RepeatComparison:
    rows = []
    for b, n in comparable:
        bp, bg = base.tallies.get((b.source, b.id), (int(b.passed), int(b.graded)))
        np_, ng = new.tallies.get((n.source, n.id), (int(n.passed), int(n.graded)))
        f = stats.fisher_exact(bp, bg - bp, np_, ng - np_)
        rows.append(RepeatCase(b.source, b.id, bp, bg, np_, ng, p_drop=f.p_greater, p_rise=f.p_less))
    deltas = [r.new_rate - r.base_rate for r in rows]
    down = sum(d < 0 for d in deltas)
    up = sum(d > 0 for d in deltas)
    drops = tuple(r for r in rows if r.new_rate < r.base_rate and r.p_drop < alpha)
    return RepeatComparison(
        base_repeats=base.repeats, new_repeats=new.repeats, cases=tuple(rows),
        base_pass_at_1=sum(r.base_rate for r in rows) / len(rows),
        new_pass_at_1=sum(r.new_rate for r in rows) / len(rows),
        interval=stats.bootstrap_mean(deltas, resamples=resamples, seed=seed), test=stats.mcnemar(down, up),
        drops=drops, rises=tuple(r for r in rows if r.new_rate > r.base_rate and r.p_rise < alpha),
        flaky_drops=tuple(r for r in rows if r.base_class == "flaky" and r.new_rate < r.base_rate
                          and r not in drops),
        became_flaky=tuple(r for r in rows if r.base_class in ("stable pass", "stable fail")
                           and r.new_class == "flaky"),
        stopped_flaky=tuple(r for r in rows if r.base_class == "flaky"
                            and r.new_class in ("stable pass", "stable fail")))


@dataclass(frozen=True)
class SourceTest:
    """One source's regression test in a family of sources, with its Holm adjustment."""

    source: str
    worse: int   # pass->fail flips (with repeats: cases passing less often)
    better: int
    p: float     # exact two-sided McNemar / sign test p
    adjusted: float  # Holm-adjusted p over the family
    regression: bool  # adjusted < alpha and worse > better


@dataclass(frozen=True)
class Assurance:
    """What a comparison could see and, when asked, whether it shows equivalence."""

    power: float
    cases: int
    discordance: float  # observed share of discordant cases (with repeats: BASE's estimated noise)
    detectable_drop: float | None  # None: no drop is detectable with this power at this n
    sources: tuple[SourceTest, ...] = ()  # per-source tests and Holm, when there are several sources
    equivalence: stats.Equivalence | None = None


@dataclass
class Comparison:
    base: Run
    new: Run
    alpha: float
    strict: bool
    allowed: tuple[str, ...]
    cases: pd.DataFrame  # one row per matched case: both sides and why it is excluded, if it is
    sources: list[SourceStats]
    total: SourceStats
    flips: list[Flip]
    lost_passes: list[str]
    length_changes: list[LengthChange]
    issues: list[Issue]
    differences: list[Difference]
    render_diffs: list[RenderDiff]
    regression: bool
    exit_status: int
    verdict: str
    repeats: RepeatComparison | None = None  # set when either run has --repeats K > 1
    assurance: Assurance | None = None  # power, per-source Holm and equivalence (see the module docstring)
    counting: TokenCounting = field(default_factory=TokenCounting)  # the token counting rules of both sides

    def judged(self) -> list[str]:
        """The names ("source/id") of the cases the verdict counts: matched and not excluded."""
        ok = self.cases[self.cases["excluded"] == ""]
        return [f"{s}/{i}" for s, i in zip(ok["source"], ok["id"])]


def _names(keys: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    return tuple(f"{s}/{i}" for s, i in keys)


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:LISTED_CASES])
    return shown + (f" and {len(names) - LISTED_CASES} more" if len(names) > LISTED_CASES else "")


def _exclusions(b: CaseRun, n: CaseRun) -> list[str]:
    why = []
    if b.case_hash and n.case_hash:
        pin_differs = b.case_hash != n.case_hash
    else:  # an older trace or summary: the answer keys stand in for the content hash
        pin_differs = b.key != n.key if len(b.key) == len(n.key) else b.expected != n.expected
    if pin_differs:
        why.append("pin")
    if (b.model_sha256 != n.model_sha256) if (b.model_sha256 and n.model_sha256) else (b.model != n.model):
        why.append("model")
    if b.prompt_sha256 and n.prompt_sha256:
        if b.prompt_sha256 != n.prompt_sha256:
            why.append("prompt")
    elif b.prompt_text and n.prompt_text and b.prompt_text != n.prompt_text:
        why.append("prompt")
    if b.sampling != n.sampling:
        why.append("sampling")
    if not (b.graded and n.graded):
        why.append("ungraded")
    return why


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing element (the shorter length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def render_diff(b: CaseRun, n: CaseRun) -> RenderDiff:
    """Where the prompts of one case differ: token texts when both runs recorded them, else
    the prompt texts character by character."""
    names = (b.name,)
    if b.rendered_token_ends and n.rendered_token_ends:
        bp, np_ = b.prompt_tokens_text(), n.prompt_tokens_text()
        pos = first_difference(bp, np_)
        if pos is None:
            return RenderDiff(names, None, len(bp), len(np_), 0, (), (),
                              "the token texts are equal but the token ids differ (another vocabulary?)")
        start = max(0, pos - CONTEXT_TOKENS)
        return RenderDiff(names, pos, len(bp), len(np_), start, tuple(bp[start:pos + CONTEXT_TOKENS + 1]),
                          tuple(np_[start:pos + CONTEXT_TOKENS + 1]))
    if b.prompt_text and n.prompt_text and b.prompt_text != n.prompt_text:
        pos = first_difference(b.prompt_text, n.prompt_text)
        start = max(0, pos - 24)
        return RenderDiff(names, None, b.prompt_tokens, n.prompt_tokens, start,
                          (b.prompt_text[start:pos + 24],), (n.prompt_text[start:pos + 24],),
                          f"no token texts recorded; the prompt texts first differ at character {pos}")
    return RenderDiff(names, None, b.prompt_tokens, n.prompt_tokens, 0, (), (),
                      "the prompt token hashes differ; neither token texts nor prompt texts show where")


def _group_render_diffs(diffs: list[RenderDiff]) -> list[RenderDiff]:
    """One entry per distinct difference, listing the cases that share it (a template or BOS
    change moves every case the same way)."""
    groups: dict[tuple, list[RenderDiff]] = {}
    for d in diffs:
        groups.setdefault((d.position, d.base_context, d.new_context, d.note), []).append(d)
    out = []
    for ds in groups.values():
        d = ds[0]
        out.append(RenderDiff(tuple(x.cases[0] for x in ds), d.position, d.base_tokens, d.new_tokens,
                              d.context_start, d.base_context, d.new_context, d.note))
    return sorted(out, key=lambda d: -len(d.cases))


def _source_stats(source: str, rows: pd.DataFrame, resamples: int, seed: int) -> SourceStats:
    bp, np_ = rows["base_pass"].to_numpy(), rows["new_pass"].to_numpy()
    pf, fp = int((bp & ~np_).sum()), int((~bp & np_).sum())
    return SourceStats(
        source=source, cases=len(rows), base_passed=int(bp.sum()), new_passed=int(np_.sum()),
        pass_fail=pf, fail_pass=fp,
        pass_fail_no_answer=int((bp & ~np_ & rows["new_no_answer"].to_numpy()).sum()),
        fail_pass_no_answer=int((~bp & np_ & rows["base_no_answer"].to_numpy()).sum()),
        base_no_answer=int((~bp & rows["base_no_answer"].to_numpy()).sum()),
        new_no_answer=int((~np_ & rows["new_no_answer"].to_numpy()).sum()),
        interval=stats.paired_bootstrap(bp, np_, resamples=resamples, seed=seed),
        test=stats.mcnemar(pf, fp),
        base_gen_tokens=int(rows["base_gen_tokens"].sum()), new_gen_tokens=int(rows["new_gen_tokens"].sum()),
        base_gen_s=float(rows["base_gen_s"].sum()), new_gen_s=float(rows["new_gen_s"].sum()),
        base_prompt_tokens=int(rows["base_prompt_tokens"].sum()),
        new_prompt_tokens=int(rows["new_prompt_tokens"].sum()))


_ISSUE_TEXT = {
    "pin": "content hash differs (the question or its key changed)",
    "model": "ran on different models",
    "prompt": "rendered prompts differ",
    "sampling": "sampling settings differ",
    "ungraded": "not graded on both sides (SKIPPED, STOPPED or ERROR)",
}


def _model_label(c: CaseRun) -> str:
    return f"{c.model} ({c.model_sha256[:12]})" if c.model_sha256 else (c.model or "?")


def _sampling_label(key: tuple) -> str:
    if key == ("greedy",):
        return "greedy"
    _, t, p, m, s = key
    return f"temp {t:g}, top-p {p:g}, min-p {m:g}, seed {'-' if s is None else s}"


def _pair_issue(kind: str, pairs: list[tuple[CaseRun, CaseRun]], allowed: bool) -> Issue:
    names = tuple(b.name for b, _ in pairs)
    text = f"{len(names)} case(s): {_ISSUE_TEXT[kind]}"
    b, n = pairs[0]
    if kind == "model":
        text += f": BASE {_model_label(b)}, NEW {_model_label(n)}"
    elif kind == "sampling":
        text += f": BASE {_sampling_label(b.sampling)}, NEW {_sampling_label(n.sampling)}"
    elif kind == "ungraded":
        text += " (" + ", ".join(f"{b.name} {b.status or '?'} -> {n.status or '?'}"
                                 for b, n in pairs[:LISTED_CASES]) + ")"
    if kind != "ungraded":
        text += f" [{_listing(names)}]"
    if allowed:
        text += f"; kept in the verdict (--allow-diff {kind})"
    elif kind in ALLOWED_DIFFS:
        text += f"; excluded (--allow-diff {kind} keeps them if this is the change under test)"
    else:
        text += "; excluded"
    return Issue(kind, text, names, excluded=not allowed)


def _differences(pairs: list[tuple[CaseRun, CaseRun]]) -> list[Difference]:
    seen: Counter = Counter()
    for b, n in pairs:
        if b.settings == n.settings:
            continue
        for k, bv, nv in zip(NOTE_FIELDS, b.settings, n.settings):
            if bv and nv and bv != nv:
                seen[(k, bv, nv)] += 1
    return [Difference(k, bv, nv, count) for (k, bv, nv), count in
            sorted(seen.items(), key=lambda kv: (NOTE_FIELDS.index(kv[0][0]), -kv[1]))]


def _provenance_gap(run: Run) -> bool:
    return any(not c.model_sha256 and not c.setting("extractor_version") for c in run.cases.values())


def compare(base: Run, new: Run, *, alpha: float = 0.05, strict: bool = False, allow: Iterable[str] = (),
            resamples: int = stats.BOOTSTRAP_RESAMPLES, seed: int = stats.BOOTSTRAP_SEED,
            top_lengths: int = 5, power: float = 0.8, equivalence: float | None = None) -> Comparison:
    with collector_paused():
        result = _compare(base, new, alpha=alpha, strict=strict, allow=allow, resamples=resamples, seed=seed,
                          top_lengths=top_lengths)
    result.assurance = assurance(result, power, equivalence)
    if equivalence is not None and not result.assurance.equivalence.equivalent:
        result.exit_status = 1
    return result


def _base_population(cmp: Comparison) -> pw.Population | None:
    """BASE as the power computation sees it; None when BASE passed nothing (nothing to lose)."""
    rc, t = cmp.repeats, cmp.total
    if rc is not None:
        counts = [(r.base_passed, r.base_graded) for r in rc.cases]
        return pw.population_from_counts(counts) if any(p for p, _ in counts) else None
    rate = t.base_rate
    if rate <= 0.0:
        return None
    return pw.population_from_rates(rate, min(t.test.discordant / t.cases, pw.max_discordance(rate)))


def _source_tests(cmp: Comparison) -> tuple[SourceTest, ...]:
    rc = cmp.repeats
    if rc is None:
        counts = [(s.source, s.pass_fail, s.fail_pass) for s in cmp.sources]
    else:
        by_source: dict[str, list[int]] = {}
        for r in rc.cases:
            tally = by_source.setdefault(r.source, [0, 0])
            tally[0] += r.new_rate < r.base_rate
            tally[1] += r.new_rate > r.base_rate
        counts = [(src, w, b) for src, (w, b) in by_source.items()]
    if len(counts) < 2:
        return ()
    ps = [stats.mcnemar(w, b).p_exact for _, w, b in counts]
    return tuple(SourceTest(src, w, b, p, h.adjusted, h.rejected and w > b)
                 for (src, w, b), p, h in zip(counts, ps, stats.holm(ps, cmp.alpha)))


def assurance(cmp: Comparison, power: float = 0.8, equivalence: float | None = None) -> Assurance:
    """The power statement, per-source Holm tests and (when `equivalence` is a margin) the TOST
    of a finished comparison. Pure."""
    rc, t = cmp.repeats, cmp.total
    pop = _base_population(cmp)
    if rc is None:
        design_repeats, n, disc = (1, 1), t.cases, t.test.discordant / t.cases
    else:
        design_repeats, n = (rc.base_repeats, rc.new_repeats), len(rc.cases)
        disc = pw.estimated_discordance([(r.base_passed, r.base_graded) for r in rc.cases]) or 0.0
    drop = None if pop is None else pw.detectable_drop(pw.Design(pop, cmp.alpha, *design_repeats), n, power)
    eq = None
    if equivalence is not None:
        if rc is None:
            eq = stats.paired_equivalence(t.pass_fail, t.fail_pass, t.cases, equivalence, cmp.alpha)
        else:
            worse = sum(r.base_rate * (1 - r.new_rate) for r in rc.cases)
            better = sum((1 - r.base_rate) * r.new_rate for r in rc.cases)
            eq = stats.paired_equivalence(worse, better, len(rc.cases), equivalence, cmp.alpha)
    return Assurance(power, n, disc, drop, _source_tests(cmp), eq)


Pair = tuple[CaseRun, CaseRun]


@dataclass
class _Matching:
    """Phase 1: the cases of both runs paired, and why each pair would stay out of the verdict."""

    only_base: list[tuple[str, str]]
    only_new: list[tuple[str, str]]
    matched: list[Pair]
    comparable: list[Pair]             # the matched pairs the verdict counts
    by_kind: dict[str, list[Pair]]     # exclusion kind -> its pairs (allowed kinds included)
    cases: pd.DataFrame                # one row per matched pair (Comparison.cases)
    render_diffs: list[RenderDiff]     # one per pair whose prompts differ, not yet grouped
    lost: list[str]                    # matched cases that passed in BASE and have no verdict in NEW
    counting: TokenCounting            # how each side counts generated tokens


@dataclass
class _Statistics:
    """Phase 3: the figures of the comparable cases."""

    sources: list[SourceStats]
    total: SourceStats
    flips: list[Flip]
    lost: list[str]  # lost passes among matched cases and cases only in BASE
    length_changes: list[LengthChange]


@dataclass
class _Verdict:
    """Phase 4: what the comparison concludes."""

    repeats: RepeatComparison | None
    regression: bool
    exit_status: int
    text: str


_CASE_COLUMNS = ["source", "id", "base_status", "new_status", "base_picked", "new_picked", "base_expected",
                 "new_expected", "base_gen_tokens", "new_gen_tokens", "base_gen_s", "new_gen_s", "base_prompt_tokens",
                 "new_prompt_tokens", "base_no_answer", "new_no_answer", "excluded"]


def _match(base: Run, new: Run, allowed: tuple[str, ...]) -> _Matching:
    """1. Pair the cases by (source, id) and find why each matched case would stay out of the verdict."""
    only_base = [k for k in base.cases if k not in new.cases]
    only_new = [k for k in new.cases if k not in base.cases]
    matched = [(base.cases[k], new.cases[k]) for k in base.cases if k in new.cases]
    counting = token_counting(matched)
    by_kind: dict[str, list[Pair]] = {}
    rows, comparable, render, lost = [], [], [], []
    for b, n in matched:
        why = _exclusions(b, n)
        if b.passed and not n.graded and "pin" not in why:
            lost.append(b.name)  # passed in BASE, no verdict in NEW
        for kind in why:
            by_kind.setdefault(kind, []).append((b, n))
        if "prompt" in why:
            render.append(render_diff(b, n))
        excluded = [k for k in why if k not in allowed]
        rows.append((b.source, b.id, b.status, n.status, b.picked, n.picked, b.expected, n.expected,
                     counting.counted(b), counting.counted(n), b.elapsed_s, n.elapsed_s, b.prompt_tokens, n.prompt_tokens,
                     b.no_answer, n.no_answer, ",".join(excluded)))
        if not excluded:
            comparable.append((b, n))
    return _Matching(only_base, only_new, matched, comparable, by_kind, pd.DataFrame(rows, columns=_CASE_COLUMNS),
                     render, lost, counting)


def _warnings(base: Run, new: Run, m: _Matching, allowed: tuple[str, ...]) -> list[Issue]:
    """2. Everything that keeps cases out of the verdict or weakens it, in the order a reader needs it."""
    issues = []
    for run in (base, new):
        for p in run.problems:
            issues.append(Issue("trace", f"{run.label}: {p}", excluded=False))
        if run.repeated:
            issues.append(Issue("repeated", f"{run.label}: {run.repeated} case record(s) superseded by later "
                                             f"records of the same case; the last one counts", excluded=False))
    if m.only_base:
        issues.append(Issue("only_base", f"{len(m.only_base)} case(s) only in BASE [{_listing(_names(m.only_base))}]; "
                                         f"excluded", _names(m.only_base)))
    if m.only_new:
        issues.append(Issue("only_new", f"{len(m.only_new)} case(s) only in NEW [{_listing(_names(m.only_new))}]; "
                                        f"excluded", _names(m.only_new)))
    for kind in ("pin", "model", "prompt", "sampling", "ungraded"):
        if kind in m.by_kind:
            issues.append(_pair_issue(kind, m.by_kind[kind], kind in allowed))
    counting_note = m.counting.note(m.matched)
    if counting_note is not None:
        issues.append(counting_note)
    for run in (base, new):
        if _provenance_gap(run):
            issues.append(Issue("provenance", f"{run.label} has cases without provenance (an older trace or "
                                               f"summary): model file, template and settings differences "
                                               f"cannot all be seen", excluded=False))
    return issues


def _require_comparable(base: Run, new: Run, m: _Matching, allowed: tuple[str, ...]) -> None:
    """CompareInputError, saying why, when no case is left for the verdict."""
    if m.comparable:
        return
    if not m.matched:
        raise CompareInputError(f"nothing to compare: BASE ({len(base.cases)} cases) and NEW "
                                f"({len(new.cases)} cases) have no case in common")
    reasons = ", ".join(f"{len(v)} {k}" for k, v in m.by_kind.items() if k not in allowed)
    hint = "; --allow-diff model|prompt|sampling keeps cases whose difference is the change under test" \
        if set(m.by_kind) & (set(ALLOWED_DIFFS) - set(allowed)) else ""
    raise CompareInputError(f"nothing to compare: none of the {len(m.matched)} matched cases is comparable "
                            f"({reasons}){hint}")


def _statistics(base: Run, m: _Matching, resamples: int, seed: int, top_lengths: int) -> _Statistics:
    """3. Pass rates, intervals and tests per source and in total, flips, lost passes and length changes."""
    ok = m.cases[m.cases["excluded"] == ""].copy()
    ok["base_pass"] = ok["base_status"] == "PASSED"
    ok["new_pass"] = ok["new_status"] == "PASSED"
    sources = [_source_stats(src, grp, resamples, seed) for src, grp in ok.groupby("source", sort=False)]
    total = _source_stats("TOTAL", ok, resamples, seed)

    flips = [Flip(b.source, b.id, "pass->fail" if b.passed else "fail->pass", b.picked, n.picked, b.expected,
                  n.expected, n.no_answer if b.passed else b.no_answer)
             for b, n in m.comparable if b.passed != n.passed]
    flips.sort(key=lambda f: (f.direction != "pass->fail", f.source, f.id))
    lost = m.lost + [base.cases[k].name for k in m.only_base if base.cases[k].passed]

    count = m.counting.counted
    moved = heapq.nsmallest(top_lengths, ((b, n) for b, n in m.comparable if count(b) != count(n)),
                            key=lambda p: (-abs(count(p[1]) - count(p[0])), p[0].source, p[0].id))
    changes = [LengthChange(b.source, b.id, count(b), count(n), b.status, n.status) for b, n in moved]
    return _Statistics(sources, total, flips, lost, changes)


def _verdict(base: Run, new: Run, comparable: list[Pair], st: _Statistics, *, alpha: float, strict: bool,
             resamples: int, seed: int) -> _Verdict:
    """4. The verdict: on the repeats' pass counts when there are repeats, else on the flips."""
    rc = (_repeat_comparison(comparable, base, new, alpha, resamples, seed)
          if max(base.repeats, new.repeats) > 1 else None)
    total, lost = st.total, st.lost
    t = total.test if rc is None else rc.test
    regression = t.p_exact < alpha and t.b > t.c
    strict_fail = strict and ((t.b > 0 if rc is None else bool(rc.drops)) or bool(lost))
    if rc is not None:
        text = _repeat_verdict(rc, regression, strict_fail, lost, alpha)
    elif regression:
        text = (f"significant regression: {t.b} pass→fail against {t.c} fail→pass of {total.cases} comparable "
                f"cases (McNemar exact p = {t.p_exact:.4g} < alpha {alpha:g})")
    elif strict_fail:
        parts = [f"{t.b} pass→fail flip(s)"] if t.b else []
        parts += [f"{len(lost)} lost pass(es)"] if lost else []
        text = (f"regression under --strict: {' and '.join(parts)} (McNemar exact p = {t.p_exact:.4g}, "
                f"not significant at alpha {alpha:g})")
    else:
        direction = "significant improvement" if t.p_exact < alpha and t.c > t.b else "no significant regression"
        text = (f"{direction}: {t.b} pass→fail, {t.c} fail→pass of {total.cases} comparable cases "
                f"(McNemar exact p = {t.p_exact:.4g}, alpha {alpha:g})")
    return _Verdict(rc, regression, 1 if regression or strict_fail else 0, text)


def _compare(base: Run, new: Run, *, alpha: float, strict: bool, allow: Iterable[str], resamples: int, seed: int,
             top_lengths: int) -> Comparison:
    allowed = tuple(sorted(set(allow)))
    if set(allowed) - set(ALLOWED_DIFFS):
        raise ValueError(f"allow takes {', '.join(ALLOWED_DIFFS)}")
    m = _match(base, new, allowed)
    issues = _warnings(base, new, m, allowed)
    _require_comparable(base, new, m, allowed)
    st = _statistics(base, m, resamples, seed, top_lengths)
    v = _verdict(base, new, m.comparable, st, alpha=alpha, strict=strict, resamples=resamples, seed=seed)
    return Comparison(
        base=base, new=new, alpha=alpha, strict=strict, allowed=allowed, cases=m.cases, sources=st.sources,
        total=st.total, flips=st.flips, lost_passes=st.lost, length_changes=st.length_changes, issues=issues,
        differences=_differences(m.matched), render_diffs=_group_render_diffs(m.render_diffs),
        regression=v.regression, exit_status=v.exit_status, verdict=v.text, repeats=v.repeats, counting=m.counting)


def _repeat_verdict(rc: RepeatComparison, regression: bool, strict_fail: bool, lost: list[str],
                    alpha: float) -> str:
    t = rc.test
    counts = (f"{t.b} case(s) passed less often, {t.c} more often, of {len(rc.cases)} comparable cases "
              f"(sign test over cases, exact p = {t.p_exact:.4g}")
    if regression:
        return f"significant regression: {counts} < alpha {alpha:g})"
    if strict_fail:
        parts = [f"{len(rc.drops)} case(s) with a significant drop (Fisher p < {alpha:g})"] if rc.drops else []
        parts += [f"{len(lost)} lost pass(es)"] if lost else []
        return f"regression under --strict: {' and '.join(parts)}; {counts}, not significant overall)"
    direction = "significant improvement" if t.p_exact < alpha and t.c > t.b else "no significant regression"
    return f"{direction}: {counts}, alpha {alpha:g})"
