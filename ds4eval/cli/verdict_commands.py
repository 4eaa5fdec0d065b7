"""`ds4-eval` commands that plan and gate on the verdict statistics: plan, reference record, gate.

Each handler takes its config (`ds4eval.config`), prints on stdout (warnings on stderr) and
returns the exit status: plan and reference record 0; gate 0 when the run holds up against its
reference and 1 when it fails it. Input it cannot use raises `UsageFailure` (exit status 2, one
line). Files are written atomically. The statistics live in `ds4eval.verdict.plan`,
`ds4eval.verdict.references` and `ds4eval.verdict.gate`; this module only wires files to them.
"""

from __future__ import annotations

import json
from collections import Counter

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, read_text, read_trace
from ds4eval.config import GATE_ALLOWED_DIFFS, PLAN_FORMATS, GateConfig, PlanConfig, ReferenceRecordConfig


def _json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


# ---------------------------------------------------------------- plan

def plan(cfg: PlanConfig) -> int:
    from ds4eval.verdict import plan as pl

    try:
        if cfg.trace_file is not None:
            parsed = read_trace(cfg.trace_file)
            for p in parsed.problems:
                click.echo(f"warning: {cfg.trace_file}: {p}", err=True)
            baseline = pl.baseline_from_records(parsed.records, cfg.trace_file).overridden(cfg.pass_rate,
                                                                                        cfg.discordance)
        else:
            baseline = pl.Baseline.given(cfg.pass_rate, cfg.discordance)
        result = pl.make_plan(baseline, alpha=cfg.alpha, power=cfg.power, drop=cfg.drop / 100, cases=cfg.cases,
                              repeats=cfg.repeats)
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    click.echo(pl.render_text(result) if cfg.format == "text" else _json_text(pl.as_json(result)), nl=False)
    return 0


_power = click.option("--power", type=float, default=0.8, show_default=True,
                      help="Chance of detecting the drop (the planned power).")

PLAN = Command(
    "plan", "Cases a comparison needs, drops it can detect.", PlanConfig, plan,
    (click.argument("trace_file", metavar="[TRACE]", required=False, type=click.Path(dir_okay=False)),
     click.option("--pass-rate", type=float, help="BASE's pass rate as a share, e.g. 0.34 (instead of TRACE's)."),
     click.option("--discordance", type=float,
                  help="Share of cases two runs of the same system disagree on (0 for greedy runs)."),
     click.option("--alpha", type=float, default=0.05, show_default=True, help="Significance level of the comparison."),
     _power,
     click.option("--drop", type=float, default=5.0, show_default=True,
                  help="Smallest drop that matters, in percentage points (5 = 34% -> 29%)."),
     click.option("--cases", type=int, help="Suite size for the detectable drop (default: TRACE's case count)."),
     click.option("--repeats", type=int, help="Also plan K repeats a side (default: TRACE's repeats)."),
     click.option("--format", "format", type=click.Choice(PLAN_FORMATS), default="text", show_default=True)),
    details="Baseline: TRACE (its repeats estimate the discordance: the noise a paired test works against), or "
            "--pass-rate with --discordance. Prints the cases needed for --drop at --power and, at --cases, the "
            "smallest detectable drop, for one run a side (McNemar), K repeats a side (sign test) and, for "
            "scale, the unpaired two-sample z-test. Exit status 0, or 2 for bad input.")


# ---------------------------------------------------------------- references and the gate

def model_quant(model: str | None, sha256: str) -> str:
    """The quantization (dominant 2-D tensor type) of the runs' model file: `model` when given
    (it must be the runs' file), else the embedded model when it is the runs' file; "" when
    neither can be read. Only the GGUF's header and tensor table are read."""
    from engine import ModelLoadError, default_model_path
    from engine.gguf_file import GGUFError, read_gguf
    from ds4eval.run.provenance import file_sha256

    try:
        path = model or default_model_path()
        sha = file_sha256(path)
    except (ModelLoadError, OSError) as e:
        if model:
            raise UsageFailure(f"cannot read --model {model}: {getattr(e, 'strerror', None) or e}") from None
        return ""
    if sha256 and sha != sha256:
        if model:
            raise UsageFailure(f"--model {model} is not the runs' model file (sha256 {sha[:12]}, the runs' "
                               f"{sha256[:12]})")
        return ""
    try:
        tensors = read_gguf(path).tensors.values()
    except GGUFError as e:
        raise UsageFailure(str(e)) from None
    kinds = Counter(t.qtype.name for t in tensors if len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else ""


def _read_references(path: str) -> list:
    from ds4eval.verdict import references as refs

    text = read_text(path)
    try:
        return refs.from_json(json.loads(text), path)
    except json.JSONDecodeError as e:
        raise UsageFailure(f"{path} is not JSON ({e.msg} at line {e.lineno})") from None
    except refs.ReferenceError as e:
        raise UsageFailure(str(e)) from None


def _write_json(path: str, obj: dict) -> None:
    try:
        write_text_atomic(path, _json_text(obj))
    except OSError as e:
        raise UsageFailure(f"cannot write {path}: {e.strerror or e}") from None


def reference_record(cfg: ReferenceRecordConfig) -> int:
    from ds4eval.verdict import references as refs

    runs = []
    for path in cfg.traces:
        parsed = read_trace(path)
        for p in parsed.problems:
            click.echo(f"warning: {path}: {p}", err=True)
        if not parsed.records:
            raise UsageFailure(f"{path}: no case records")
        runs.append((path, parsed.records))
    existing = _read_references(cfg.into) if cfg.into else []
    try:
        quant = model_quant(cfg.model, runs[0][1][0].model_sha256)
        ref = refs.record(runs, quant)
    except refs.ReferenceError as e:
        raise UsageFailure(str(e)) from None
    replaced = any(not r.key.differences(ref.key) for r in existing)
    target = cfg.into or cfg.output
    _write_json(target, refs.to_json(refs.upsert(existing, ref)))
    click.echo(f"{'replaced' if replaced else 'recorded'} the reference of {ref.key.describe()} in {target}: "
               f"{ref.runs} runs, {len(ref.cases)} cases, passes per run {min(ref.run_passed)}-{max(ref.run_passed)}")
    return 0


def gate(cfg: GateConfig) -> int:
    from ds4eval.verdict import gate as gt
    from ds4eval.verdict import references as refs

    parsed = read_trace(cfg.trace_file)
    for p in parsed.problems:
        click.echo(f"warning: {cfg.trace_file}: {p}", err=True)
    if not parsed.records:
        raise UsageFailure(f"{cfg.trace_file}: no case records")
    references = _read_references(cfg.references)
    try:
        key = refs.key_of(parsed.records, model_quant(cfg.model, parsed.records[0].model_sha256))
        reference = refs.find(references, key, cfg.allow_diff)
        counts, k = gt.run_counts(parsed.records)
        result = gt.judge(reference, counts, k, alpha=cfg.alpha, power=cfg.power)
    except (refs.ReferenceError, gt.GateInputError) as e:
        raise UsageFailure(str(e)) from None
    click.echo(gt.render_text(result) if cfg.format == "text" else _json_text(gt.as_json(result)), nl=False)
    return result.exit_status


def _record_build(traces: tuple[str, ...], **flags) -> ReferenceRecordConfig:
    return ReferenceRecordConfig(tuple(traces), **flags)


REFERENCE_RECORD = Command(
    "reference record", "Record a reference from repeated runs.", ReferenceRecordConfig, reference_record,
    (click.argument("traces", metavar="RUN.trace...", nargs=-1, required=True, type=click.Path(dir_okay=False)),
     click.option("-o", "output", type=click.Path(dir_okay=False), metavar="FILE",
                  help="Write a new reference file holding this reference."),
     click.option("--into", type=click.Path(dir_okay=False), metavar="FILE",
                  help="Add the reference to FILE, replacing one recorded under the same key."),
     click.option("--model", type=click.Path(dir_okay=False), metavar="GGUF",
                  help="The runs' model file, to record its quantization (default: the embedded model if it "
                       "is the runs')."),),
    details="Every repeat of every trace is one run; all must share model, quantization, KV cache type, suite and "
            "sampling, and the same cases. The file keeps ids, content hashes and pass counts only "
            "(docs/verdicts.md). Exit status 0, or 2 for bad input.",
    build=_record_build)
GATE = Command(
    "gate", "Judge a run against its recorded reference.", GateConfig, gate,
    (click.argument("trace_file", metavar="RUN.trace", type=click.Path(dir_okay=False)),
     click.option("--references", required=True, type=click.Path(dir_okay=False), metavar="FILE",
                  help="The reference file (ds4-eval reference record)."),
     click.option("--alpha", type=float, default=0.01, show_default=True,
                  help="Chance that an unchanged system fails the gate."),
     _power,
     click.option("--model", type=click.Path(dir_okay=False), metavar="GGUF",
                  help="The run's model file, for its quantization (default: the embedded model if it is the run's)."),
     click.option("--allow-diff", "allow_diff", multiple=True, type=click.Choice(GATE_ALLOWED_DIFFS),
                  help="Judge against the reference of another model file or KV cache type (the change under test)."),
     click.option("--format", "format", type=click.Choice(PLAN_FORMATS), default="text", show_default=True)),
    details="Finds the reference recorded under the run's model, quantization, KV cache type, suite and sampling; "
            "fails when the run passes fewer cases than the reference's measured noise allows at --alpha "
            "(docs/verdicts.md). Exit status 0 pass, 1 fail, 2 bad input (no matching reference, among others).")
