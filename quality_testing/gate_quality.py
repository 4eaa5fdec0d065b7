"""Quality gate: the sanity suite under greedy decoding must pass at least the recorded number of cases.

    python -m quality_testing.gate_quality            # run and judge against sanity_record.json
    python -m quality_testing.gate_quality --record   # run and write the record (a deliberate act)

The suite runs through ds4-eval's own command line (`ds4-eval --suite sanity --plain
--temp 0 --summary FILE`, engine backend, embedded model unless --model), so the gate
measures exactly what a user runs. The summary's `totals.passed` is compared with
sanity_record.json: {"suite", "passed", "cases", "tokens", "model_sha256"}; the run uses the
record's token budget unless --tokens is given. Fewer passes
fail the gate (exit 1); more passes are reported with a reminder to raise the record on
purpose. The record is only written with --record, never as a side effect.
scorer coverage (validate_scores) is a separate step of `make gate-quality`.
It does not grade anything itself.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from ds4eval.atomicfile import write_text_atomic
from quality_testing import refset as rs

RECORD = Path(__file__).resolve().parent / "sanity_record.json"
SUITE = "sanity"


class QualityGateError(RuntimeError):
    """The suite could not be run or its summary read; the message says why."""


@dataclass(frozen=True)
class QualityGateConfig:
    """One quality-gate run; each field is one command-line flag."""

    record: bool = False  # write the measured count as the new record instead of judging
    model: str | None = None  # GGUF; None: the embedded model
    tokens: int | None = None  # ds4-eval -n budget per case; None: ds4-eval's default
    record_file: str = str(RECORD)


def run_suite(cfg: QualityGateConfig) -> dict:
    """ds4-eval's JSON summary of a greedy sanity run."""
    exe = Path(sys.executable).with_name("ds4-eval")
    with tempfile.TemporaryDirectory(prefix="ds4-gate-quality-") as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [str(exe), "--suite", SUITE, "--plain", "--temp", "0", "--summary", str(summary)]
        if cfg.model:
            cmd += ["--model", cfg.model]
        if cfg.tokens:
            cmd += ["--tokens", str(cfg.tokens)]
        p = subprocess.run(cmd, stdout=sys.stderr)  # the run's own report goes to stderr, live
        if not summary.is_file():
            raise QualityGateError(f"ds4-eval exited with {p.returncode} and wrote no summary")
        return json.loads(summary.read_text(encoding="utf-8"))


def judge(passed: int, record: dict) -> tuple[bool, str]:
    """(ok, message) for a measured pass count against the record. Pure."""
    want = int(record["passed"])
    if passed < want:
        return False, f"sanity: {passed} passed, below the recorded {want}"
    if passed > want:
        return True, (f"sanity: {passed} passed, above the recorded {want}; raise the record on purpose with "
                      f"python -m quality_testing.gate_quality --record")
    return True, f"sanity: {passed} passed, as recorded"


@click.command()
@click.option("--record", "write_record", is_flag=True, help="Write the measured count as the new record.")
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--tokens", type=int, default=None, help="Generation budget per case (ds4-eval -n).")
@click.option("--record-file", default=str(RECORD), show_default=True, help="Where the record lives.")
def main(write_record: bool, model: str | None, tokens: int | None, record_file: str) -> None:
    """Run the sanity suite greedily and compare its pass count with the record."""
    cfg = QualityGateConfig(record=write_record, model=model, tokens=tokens, record_file=record_file)
    path = Path(cfg.record_file)
    try:
        record = None if cfg.record else json.loads(path.read_text(encoding="utf-8"))
        if record is not None and cfg.tokens is None:  # judge under the budget the record was made with
            cfg = dataclasses.replace(cfg, tokens=record.get("tokens"))
        summary = run_suite(cfg)
        totals = summary["totals"]
    except FileNotFoundError:
        click.echo(f"error: no record at {path}; create it with python -m quality_testing.gate_quality --record",
                   err=True)
        sys.exit(2)
    except (QualityGateError, OSError, KeyError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    passed = int(totals["passed"])
    if cfg.record:
        from engine import default_model_path

        rec = {"suite": SUITE, "passed": passed, "cases": int(totals["cases"]), "tokens": cfg.tokens,
               "model_sha256": rs.sha256_file(cfg.model or default_model_path())}
        write_text_atomic(path, json.dumps(rec, indent=1) + "\n")
        click.echo(f"recorded: {passed}/{rec['cases']} sanity cases pass")
        return
    ok, msg = judge(passed, record)
    click.echo(msg)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
