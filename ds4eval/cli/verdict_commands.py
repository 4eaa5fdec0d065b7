"""`ds4-eval` commands that plan and gate on the verdict statistics: plan, reference record, gate.

Each handler takes its config (`ds4eval.config`), prints on stdout (warnings on stderr) and
returns the exit status: plan and reference record 0; gate 0 when the run holds up against its
reference and 1 when it fails it. Input it cannot use raises `UsageFailure` (exit status 2, one
line). Files are written atomically. The statistics live in `ds4eval.verdict.plan`,
`ds4eval.verdict.references` and `ds4eval.verdict.gate`; this module only wires files to them.
"""

from __future__ import annotations

import json
import os

import click

from ds4eval.cli.command import Command
from ds4eval.cli.inputs import UsageFailure, read_text, read_trace
from ds4eval.config import PLAN_FORMATS, GateConfig, PlanConfig, ReferenceRecordConfig


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
            baseline = pl.baseline_from_records(parsed.records, cfg.trace_file)
            if cfg.pass_rate is not None or cfg.discordance is not None:
                rate = cfg.pass_rate if cfg.pass_rate is not None else baseline.population.pass_rate
                disc = cfg.discordance if cfg.discordance is not None else baseline.discordance
                given = pl.Baseline.given(rate, disc)
                baseline = pl.Baseline(baseline.label, given.population, disc, "given" if cfg.discordance is not None
                                       else baseline.discordance_note, baseline.cases, baseline.repeats)
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
