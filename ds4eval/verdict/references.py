"""Reference results: how a configuration scored over N repeated runs, keyed by what decides it. Pure.

A reference says "this model file, quantization, KV cache type, suite and sampling, run N times,
passed these cases this often": the measured noise `ds4-eval gate` judges a new run against.

File format (JSON, UTF-8; `to_json` writes it, `from_json` reads and checks it):

    {"format": "ds4eval-references", "version": 1,
     "references": [
       {"key": {"model": "<model name>", "model_sha256": "<hex or empty>", "quant": "<Q4_1...or empty>",
                "kv_type": "<float16...>", "suite": "<suite>", "temperature": 0.7, "top_p": 1.0,
                "min_p": 0.0, "max_tokens": 128, "thinking": false},
        "runs": N,                        # repeated runs recorded (each repeat of a trace is one run)
        "seeds": [S, S+1, ...],           # the sampler seed of each run (null when none was set)
        "run_passed": [31, 29, ...],      # each run's passes: the overall spread
        "run_graded": [41, 41, ...],      # each run's graded cases
        "run_passed_by_source": {"sanity": [31, 29, ...]},   # each run's passes per source
        "recorded": {"ds4eval_version": "...", "git_commit": "...", "device": "..."},  # read only
        "cases": [{"source": "sanity", "id": "int-add-small", "case_hash": "sha256:...",
                   "passed": 7, "graded": 12}, ...]}]}   # per case: the spread over the N runs

It holds ids, content hashes and counts only: no question, prompt, answer key or output, so a
reference of a private benchmark can be shared without its text.

Contract
- `key_of(records, quant)`: the key of a run's records; `ReferenceError` when they mix settings.
  `max_tokens` is the largest per-case budget (the --tokens of the run, capped by the cases').
- `record(runs, quant)`: a `Reference` from several traces' records, each trace's repeats
  counted as separate runs; every run must have the same key and the same cases (by content hash).
- `ReferenceKey.differences(other)`: the fields that differ, as (field, this, other). The model
  is compared by file SHA-256 when both know it, else by name; the quantization only when both
  know it (a file SHA-256 already fixes it).
- `find(references, key, allow=())`: the reference recorded under an equal key, differences in the
  ALLOWED_DIFFS named by `allow` aside ("model": name, SHA-256 and quantization, for a model file
  under test against its original's reference; "kv_type"); `ReferenceError` whose one line
  names the fields in which the closest reference differs when none matches.
- `upsert(references, ref)`: the list with `ref` added, or in place of the one with an equal key.
- `to_json` / `from_json`: the file's dict; `from_json` raises `ReferenceError` (one line) for
  anything that is not a version-1 reference file.
It reads and writes no files (`ds4eval.cli.verdict_commands` does, atomically).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

from ds4eval.run.trace import TraceRecord

FORMAT = "ds4eval-references"
VERSION = 1
GRADED = ("PASSED", "FAILED")
ALLOWED_DIFFS = {"model": ("model", "model_sha256", "quant"), "kv_type": ("kv_type",)}
"""Differences `find` may be told to overlook: the change under test, named as in the key."""


class ReferenceError(ValueError):
    """A reference cannot be recorded, read or found; the message is one line."""


@dataclass(frozen=True)
class ReferenceKey:
    model: str
    model_sha256: str
    quant: str
    kv_type: str
    suite: str
    temperature: float
    top_p: float
    min_p: float
    max_tokens: int
    thinking: bool

    def differences(self, other: "ReferenceKey") -> list[tuple[str, object, object]]:
        out = []
        if self.model_sha256 and other.model_sha256:
            if self.model_sha256 != other.model_sha256:
                out.append(("model_sha256", self.model_sha256[:12], other.model_sha256[:12]))
        elif self.model != other.model:
            out.append(("model", self.model, other.model))
        if self.quant and other.quant and self.quant != other.quant:
            out.append(("quant", self.quant, other.quant))
        greedy = not self.temperature and not other.temperature
        for f in ("kv_type", "suite", "temperature", "top_p", "min_p", "max_tokens", "thinking"):
            if greedy and f in ("top_p", "min_p"):
                continue  # greedy decoding ignores them
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append((f, a, b))
        return out

    def describe(self) -> str:
        sampling = "greedy" if not self.temperature else \
            f"temp {self.temperature:g}, top-p {self.top_p:g}, min-p {self.min_p:g}"
        model = f"{self.model} ({self.model_sha256[:12] or 'no sha256'}, {self.quant or 'quant unknown'})"
        return (f"{model}, kv {self.kv_type or '?'}, suite {self.suite}, {sampling}, {self.max_tokens} tokens, "
                f"thinking {'on' if self.thinking else 'off'}")


@dataclass(frozen=True)
class ReferenceCase:
    source: str
    id: str
    case_hash: str
    passed: int
    graded: int

    @property
    def name(self) -> str:
        return f"{self.source}/{self.id}"


@dataclass(frozen=True)
class Reference:
    key: ReferenceKey
    runs: int
    seeds: tuple[int | None, ...]
    run_passed: tuple[int, ...]
    run_graded: tuple[int, ...]
    recorded: dict
    cases: tuple[ReferenceCase, ...]
    run_passed_by_source: dict[str, tuple[int, ...]]

    @property
    def pass_rate(self) -> float:
        return sum(self.run_passed) / max(1, sum(self.run_graded))


def key_of(records: Sequence[TraceRecord], quant: str = "") -> ReferenceKey:
    """The key of one run's records (see the module docstring)."""
    if not records:
        raise ReferenceError("no case records")
    keys = {(r.model, r.model_sha256, r.kv_type, r.suite, float(r.temperature or 0.0),
             float(r.top_p), float(r.min_p or 0.0), bool(r.thinking)) for r in records}
    if len(keys) > 1:
        varying = [name for name, values in zip(("model", "model_sha256", "kv_type", "suite", "temperature",
                                                 "top_p", "min_p", "thinking"), zip(*keys)) if len(set(values)) > 1]
        raise ReferenceError(f"the records mix settings ({', '.join(varying)}): record one reference per setting")
    model, sha, kv, suite, temp, top_p, min_p, thinking = keys.pop()
    return ReferenceKey(model, sha, quant, kv, suite, temp, top_p, min_p,
                        max(int(r.max_tokens or 0) for r in records), thinking)


def _runs_of(records: Sequence[TraceRecord]) -> dict[int, dict[tuple[str, str], TraceRecord]]:
    """repeat index -> case -> its latest record (retries append)."""
    out: dict[int, dict[tuple[str, str], TraceRecord]] = {}
    for r in records:
        out.setdefault(r.repeat, {})[(r.source, r.id)] = r
    return out


def record(traces: Iterable[tuple[str, Sequence[TraceRecord]]], quant: str = "") -> Reference:
    """A reference from the runs of several traces (label, records), each repeat one run."""
    traces = list(traces)
    if not traces:
        raise ReferenceError("no runs to record")
    key, cases, first = None, None, ""
    seeds, run_passed, run_graded = [], [], []
    by_source: dict[str, list[int]] = {}
    passed: dict[tuple[str, str], int] = {}
    graded: dict[tuple[str, str], int] = {}
    hashes: dict[tuple[str, str], str] = {}
    for label, records in traces:
        if not records:
            raise ReferenceError(f"{label}: no case records")
        k = key_of(records, quant)
        if key is None:
            key, first = k, label
        elif k.differences(key):
            field, a, b = k.differences(key)[0]
            raise ReferenceError(f"{label} differs from {first} in {field} ({a} against {b}): "
                                 f"record one reference per setting")
        for repeat, by_case in sorted(_runs_of(records).items()):
            these = {c: r.case_hash for c, r in by_case.items()}
            if cases is None:
                cases, hashes = list(these), these
            elif these != hashes:
                raise ReferenceError(f"{label} (repeat {repeat}) does not hold the same cases as {first}: a "
                                     f"reference needs every run on the same cases")
            seeds.append(next(iter(by_case.values())).seed)
            run_passed.append(sum(r.status == "PASSED" for r in by_case.values()))
            for (source, _), r in by_case.items():
                by_source.setdefault(source, [0] * (len(run_passed) - 1))
            for source, tally in by_source.items():
                tally.append(sum(r.status == "PASSED" for (s, _), r in by_case.items() if s == source))
            run_graded.append(sum(r.status in GRADED for r in by_case.values()))
            for c, r in by_case.items():
                passed[c] = passed.get(c, 0) + (r.status == "PASSED")
                graded[c] = graded.get(c, 0) + (r.status in GRADED)
    last = traces[-1][1][-1]
    recorded = {"ds4eval_version": last.ds4eval_version, "git_commit": last.git_commit, "device": last.device}
    return Reference(key, len(run_passed), tuple(seeds), tuple(run_passed), tuple(run_graded), recorded,
                     tuple(ReferenceCase(s, i, hashes[(s, i)], passed[(s, i)], graded[(s, i)]) for s, i in cases),
                     {src: tuple(v) for src, v in by_source.items()})


def find(references: Sequence[Reference], key: ReferenceKey, allow: Iterable[str] = ()) -> Reference:
    overlooked = {f for name in allow for f in ALLOWED_DIFFS[name]}

    def differences(ref: Reference) -> list[tuple[str, object, object]]:
        return [d for d in ref.key.differences(key) if d[0] not in overlooked]

    for ref in references:
        if not differences(ref):
            return ref
    if not references:
        raise ReferenceError("the reference file holds no reference")
    closest = min(references, key=lambda r: len(differences(r)))
    diffs = "; ".join(f"{f}: reference {a}, run {b}" for f, a, b in differences(closest))
    raise ReferenceError(f"no reference matches this run ({len(references)} in the file); the closest differs in "
                         f"{diffs}")


def upsert(references: Sequence[Reference], ref: Reference) -> list[Reference]:
    out = list(references)
    for i, r in enumerate(out):
        if not r.key.differences(ref.key):
            out[i] = ref
            return out
    return out + [ref]


# ---------------------------------------------------------------- the file

def to_json(references: Sequence[Reference]) -> dict:
    return {"format": FORMAT, "version": VERSION, "references": [
        {"key": asdict(r.key), "runs": r.runs, "seeds": list(r.seeds), "run_passed": list(r.run_passed),
         "run_graded": list(r.run_graded),
         "run_passed_by_source": {src: list(v) for src, v in r.run_passed_by_source.items()},
         "recorded": dict(r.recorded),
         "cases": [asdict(c) for c in r.cases]} for r in references]}


def _key_from(obj: dict) -> ReferenceKey:
    types = {"temperature": float, "top_p": float, "min_p": float, "max_tokens": int, "thinking": bool}
    values = {}
    for f in fields(ReferenceKey):
        v = obj[f.name]
        want = types.get(f.name, str)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise TypeError(f.name)
        values[f.name] = v
    return ReferenceKey(**values)


def _case_from(obj: dict) -> ReferenceCase:
    c = ReferenceCase(str(obj["source"]), str(obj["id"]), str(obj["case_hash"]), int(obj["passed"]),
                      int(obj["graded"]))
    if not 0 <= c.passed <= c.graded:
        raise ValueError(c.name)
    return c


def from_json(obj: object, label: str = "the reference file") -> list[Reference]:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ReferenceError(f"{label} is not a ds4-eval reference file (format {FORMAT!r})")
    if obj.get("version") != VERSION:
        raise ReferenceError(f"{label} is reference format version {obj.get('version')!r}; this ds4-eval reads "
                             f"version {VERSION}")
    out = []
    for i, r in enumerate(obj.get("references") or [], 1):
        try:
            runs = int(r["runs"])
            ref = Reference(_key_from(r["key"]), runs, tuple(r["seeds"]), tuple(int(x) for x in r["run_passed"]),
                            tuple(int(x) for x in r["run_graded"]), dict(r.get("recorded") or {}),
                            tuple(_case_from(c) for c in r["cases"]),
                            {str(src): tuple(int(x) for x in v) for src, v in r["run_passed_by_source"].items()})
        except (KeyError, TypeError, ValueError) as e:
            raise ReferenceError(f"{label}: reference {i} is malformed ({type(e).__name__}: {e})") from None
        if not ref.cases or len(ref.run_passed) != runs or any(c.graded > runs for c in ref.cases) \
                or any(len(v) != runs for v in ref.run_passed_by_source.values()) \
                or set(ref.run_passed_by_source) != {c.source for c in ref.cases}:
            raise ReferenceError(f"{label}: reference {i} is inconsistent (its cases, runs and counts disagree)")
        out.append(ref)
    return out
