"""Quality gate: the greedy sanity suite, case by case against a committed baseline trace.

    python -m quality_testing.gate_quality                # run, compare with the baseline, judge
    python -m quality_testing.gate_quality --rebaseline   # run, show the comparison, replace the baseline

The suite runs through ds4-eval's own command line (`ds4-eval run --suite sanity --plain --temp 0
--tokens 128 --trace FILE`, engine backend, embedded model unless --model), so the gate
measures exactly what a user runs.  It runs on the reference CPU path (`reference_environment`):
on an x86-64 CPU with AVX2 the engine's avx2 kernels and torch's own AVX2 code
(DS4_CPU_KERNELS=avx2, ATEN_CPU_CAPABILITY=avx2), the same instructions, and so the same bits,
on every such CPU, AVX2-only or AVX512, Intel or AMD: a baseline made on one holds on the
others.  `--cpu-kernels` runs another path (whose greedy tokens may differ at near-ties). The run is then compared with `sanity_baseline.trace`
(`ds4eval.verdict.compare`, strict): greedy decoding of one model file is deterministic, so any
pass->fail flip fails the gate (exit 1), as does a significant drop; a baseline made on another
model file is refused before anything runs (exit 2). The markdown comparison is printed either
way. Cases that now pass where the baseline failed are reported with a reminder to re-baseline
on purpose. The baseline is only written with --rebaseline, never as a side effect, after the
comparison with the old one has been printed (it belongs in the re-baseline commit).
Scorer coverage (validate_scores) is a separate step of `make gate-quality`.
It does not grade anything itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click

from ds4eval.atomicfile import atomic_path
from ds4eval.reports import formats as reports
from ds4eval.run.provenance import file_sha256
from ds4eval.verdict import compare as cmp
from engine import kernels

BASELINE = Path(__file__).resolve().parent / "sanity_baseline.trace"
SUITE = "sanity"
TOKENS = 128  # generation budget per case: the sanity cases' answers fit, and a run takes about a minute


class QualityGateError(RuntimeError):
    """The suite could not be run or the baseline read; the message says why."""


@dataclass(frozen=True)
class QualityGateConfig:
    """One quality-gate run; each field is one command-line flag."""

    rebaseline: bool = False  # write the run's trace as the new baseline instead of judging
    model: str | None = None  # GGUF; None: the embedded model
    cpu_kernels: str | None = None  # engine.kernels path; None: the reference path (reference_environment)
    tokens: int = TOKENS  # ds4-eval -n budget per case
    baseline: str = str(BASELINE)


REFERENCE_PATH = "avx2"


def reference_environment(cpu_kernels: str | None, host_paths: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment the suite runs in: `cpu_kernels` if given; else, where the CPU runs the
    avx2 path, that path with torch's own ops on AVX2 too; else `env` as it is.  Pure."""
    env = dict(env)
    if cpu_kernels is not None:
        env["DS4_CPU_KERNELS"] = cpu_kernels
    elif REFERENCE_PATH in host_paths:
        env["DS4_CPU_KERNELS"] = REFERENCE_PATH
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    return env


def run_suite(cfg: QualityGateConfig, trace: Path) -> None:
    """A greedy sanity run through ds4-eval, its trace written to `trace`."""
    exe = Path(sys.executable).with_name("ds4-eval")
    cmd = [str(exe), "run", "--suite", SUITE, "--plain", "--temp", "0", "--tokens", str(cfg.tokens),
           "--trace", str(trace)]
    if cfg.model:
        cmd += ["--model", cfg.model]
    env = reference_environment(cfg.cpu_kernels, kernels.host_paths(), dict(os.environ))
    # the run's own report goes to stderr, live
    p = subprocess.run(cmd, stdout=sys.stderr, env=env)
    if not trace.is_file():  # a run cut short still has a trace; the comparison then counts what is missing
        raise QualityGateError(f"ds4-eval exited with {p.returncode} and wrote no trace")


def baseline_model(run: cmp.Run) -> str:
    """The model file SHA-256 the baseline was made on ("" when it does not record one)."""
    shas = Counter(c.model_sha256 for c in run.cases.values())
    if len(shas) != 1:
        raise QualityGateError(f"the baseline mixes {len(shas)} model files; re-baseline on one")
    return next(iter(shas))


def judge(base: cmp.Run, new: cmp.Run) -> cmp.Comparison:
    """The gate's comparison: strict, default alpha, no difference allowed. Pure."""
    return cmp.compare(base, new, strict=True)


def _read_run(path: Path, label: str) -> cmp.Run:
    return cmp.read_run(path.read_text(encoding="utf-8"), label)


@click.command()
@click.option("--rebaseline", is_flag=True, help="Write this run's trace as the new baseline (on purpose).")
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--tokens", type=int, default=TOKENS, show_default=True, help="Generation budget per case (ds4-eval -n).")
@click.option("--baseline", default=str(BASELINE), show_default=True, help="The baseline trace.")
@click.option("--cpu-kernels", type=click.Choice(kernels.PATHS), default=None,
              help="Engine CPU kernel path (default: avx2 with torch's AVX2 code where the CPU runs it, the "
                   "path whose bits every such CPU shares).")
def main(rebaseline: bool, model: str | None, tokens: int, baseline: str, cpu_kernels: str | None) -> None:
    """Run the sanity suite greedily and compare it case by case with the baseline trace."""
    from engine import ModelLoadError, default_model_path

    cfg = QualityGateConfig(rebaseline=rebaseline, model=model, tokens=tokens, baseline=baseline,
                            cpu_kernels=cpu_kernels)
    path = Path(cfg.baseline)
    try:
        old = _read_run(path, path.name) if path.is_file() else None
        if old is None and not cfg.rebaseline:
            raise QualityGateError(f"no baseline at {path}; create it with "
                                   f"python -m quality_testing.gate_quality --rebaseline")
        if old is not None and not cfg.rebaseline:
            want, have = baseline_model(old), file_sha256(cfg.model or default_model_path())
            if want != have:
                raise QualityGateError(f"the baseline was made on model sha256 {want[:12] or '(unknown)'}, this model "
                                       f"is {have[:12]}: compare like with like, or re-baseline on purpose")
        with tempfile.TemporaryDirectory(prefix="ds4-gate-quality-") as tmp:
            trace = Path(tmp) / "sanity.trace"
            run_suite(cfg, trace)
            new = _read_run(trace, "this run")
            result = None
            if old is not None:
                try:
                    result = judge(old, new)
                except cmp.CompareInputError as e:
                    if not cfg.rebaseline:
                        raise
                    click.echo(f"no comparison with the old baseline: {e}")
            if result is not None:
                click.echo(reports.render_comparison(result, "markdown"))
            if cfg.rebaseline:
                with atomic_path(path) as out:
                    shutil.copyfile(trace, out)
                click.echo(f"wrote the baseline {path} ({len(new.cases)} cases, "
                           f"{sum(c.passed for c in new.cases.values())} passed); commit it with the comparison "
                           f"above in the commit message")
                return
    except (cmp.CompareInputError, QualityGateError, OSError, ModelLoadError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    t = result.total
    if result.exit_status == 0 and t.fail_pass:
        click.echo(f"sanity: {t.fail_pass} case(s) now pass that failed in the baseline; re-baseline on purpose "
                   f"with python -m quality_testing.gate_quality --rebaseline")
    click.echo(f"sanity: {t.new_passed}/{t.cases} passed (baseline {t.base_passed}); "
               f"{'FAILED' if result.exit_status else 'ok'}: {result.verdict}")
    sys.exit(result.exit_status)


if __name__ == "__main__":
    main()
