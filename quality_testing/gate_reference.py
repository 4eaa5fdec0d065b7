"""Reference gate: a sampled sanity run of the embedded model judged against its recorded reference.

    python -m quality_testing.gate_reference                  # one gate run (a step of `make gate`)
    python -m quality_testing.gate_reference --trials 20      # the false-alarm measurement: 20 gate runs
    python -m quality_testing.gate_reference --record         # record sanity_references.json again (on purpose)
    python -m quality_testing.gate_reference --write-degraded /tmp/degraded.gguf   # a test-only damaged model
    python -m quality_testing.gate_reference --model /tmp/degraded.gguf            # ... judged against the reference

Where `gate_quality` compares a greedy run with a baseline trace case by case (any flip fails),
this gate samples (--temp 0.7, 128 tokens a case, REPEATS repeats from seed SEED) and asks
`ds4-eval gate` whether the run's passes are within the noise measured by the reference: the
pass counts of REFERENCE_RUNS sampled runs of the same model file, KV cache type and settings
(`sanity_references.json`, ids, content hashes and counts only). It fails (exit 1) when the run
passes fewer cases than that noise allows at ALPHA; 2 for input it cannot judge (no reference
for this model file or settings among them). The suite runs through `ds4-eval run` on the
reference CPU path, as in `gate_quality`.

`--trials N` runs the gate N times on seeds SEED, SEED + REPEATS, ... (never a reference seed)
and prints how many failed: the measured false-alarm rate of unchanged code. `--write-degraded
OUT` writes a copy of the model with one tensor scaled (DEGRADED_TENSOR times DEGRADED_SCALE,
an F32 norm weight patched in place: the rest of the file is byte for byte the original), a
deliberately damaged engine without a hook in the engine; `--model OUT` then judges it against
the original's reference (the gate is told the model file is the change under test). Halving
the final norm halves every logit: greedy decoding (an argmax) does not change, so the greedy
gate cannot see it, while sampling at 0.7 behaves as at 1.4, the kind of temperature or scale
bug only a sampled gate catches.
It grades nothing itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from quality_testing.gate_quality import reference_environment

REFERENCES = Path(__file__).resolve().parent / "sanity_references.json"
SUITE = "sanity"
TEMPERATURE = 0.7
TOKENS = 128
REPEATS = 3  # repeats of a gate run: a drop of about 10 points of the sanity suite's ~17% is caught with power 0.8
SEED = 9000  # the gate's first seed; the reference's are REFERENCE_SEED onwards, far from it
ALPHA = 0.01  # the chance that unchanged code fails one gate run
REFERENCE_SEED = 1000
REFERENCE_RUNS = 48  # recorded as REFERENCE_TRACES traces of REFERENCE_RUNS / REFERENCE_TRACES repeats
REFERENCE_TRACES = 4
DEGRADED_TENSOR = "output_norm.weight"
DEGRADED_SCALE = 0.5


class ReferenceGateError(RuntimeError):
    """The suite could not be run; the message says why."""


@dataclass(frozen=True)
class SampledRun:
    """One sampled sanity run: what `ds4-eval run` is asked for."""

    seed: int
    repeats: int
    model: str | None = None

    def command(self, trace: Path) -> list[str]:
        cmd = [str(Path(sys.executable).with_name("ds4-eval")), "run", "--suite", SUITE, "--plain", "--temp",
               str(TEMPERATURE), "--seed", str(self.seed), "--repeats", str(self.repeats), "--tokens", str(TOKENS),
               "--trace", str(trace)]
        return cmd + (["--model", self.model] if self.model else [])


def gate_command(trace: Path, references: Path, model: str | None) -> list[str]:
    cmd = [str(Path(sys.executable).with_name("ds4-eval")), "gate", str(trace), "--references", str(references),
           "--alpha", str(ALPHA)]
    return cmd + (["--model", model, "--allow-diff", "model"] if model else [])


def run_sampled(run: SampledRun, trace: Path) -> None:
    env = reference_environment(None, _host_paths(), dict(os.environ))
    p = subprocess.run(run.command(trace), stdout=subprocess.DEVNULL, env=env)
    if not trace.is_file():
        raise ReferenceGateError(f"ds4-eval run exited with {p.returncode} and wrote no trace")


def _host_paths() -> list[str]:
    from engine import kernels

    return kernels.host_paths()


def gate_once(seed: int, references: Path, model: str | None, workdir: Path) -> int:
    """One gate run: the suite sampled from `seed`, then `ds4-eval gate`; its exit status.
    The trace is left in `workdir` as gate-SEED.trace."""
    trace = workdir / f"gate-{seed}.trace"
    run_sampled(SampledRun(seed, REPEATS, model), trace)
    return subprocess.run(gate_command(trace, references, model)).returncode


def scaled_tensor_copy(src: str, dst: str, tensor: str, scale: float) -> None:
    """Copy the GGUF `src` to `dst` with the F32 tensor `tensor` multiplied by `scale`."""
    from gguf import GGMLQuantizationType, GGUFReader

    found = [t for t in GGUFReader(src).tensors if t.name == tensor]
    if not found or found[0].tensor_type != GGMLQuantizationType.F32:
        raise ReferenceGateError(f"{src} has no F32 tensor {tensor}")
    t = found[0]
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(t.data_offset)
        values = np.frombuffer(f.read(t.n_bytes), dtype="<f4") * np.float32(scale)
        f.seek(t.data_offset)
        f.write(values.astype("<f4").tobytes())


@click.command()
@click.option("--trials", type=int, default=1, show_default=True, help="Gate runs, on seeds REPEATS apart.")
@click.option("--seed", type=int, default=SEED, show_default=True, help="Seed of the first gate run.")
@click.option("--model", default=None, help="GGUF under test (default: the embedded model).")
@click.option("--references", default=str(REFERENCES), show_default=True, help="The reference file.")
@click.option("--record", is_flag=True, help="Record the reference file again from REFERENCE_RUNS sampled runs.")
@click.option("--keep-traces", metavar="DIR", default=None, help="Keep each run's trace in DIR (gate-SEED.trace).")
@click.option("--write-degraded", metavar="OUT", default=None,
              help=f"Write the embedded model with {DEGRADED_TENSOR} scaled by {DEGRADED_SCALE} to OUT.")
def main(trials: int, seed: int, model: str | None, references: str, record: bool, keep_traces: str | None,
         write_degraded: str | None) -> None:
    """Judge sampled sanity runs against the recorded reference."""
    from engine import ModelLoadError, default_model_path

    try:
        if write_degraded:
            scaled_tensor_copy(default_model_path(), write_degraded, DEGRADED_TENSOR, DEGRADED_SCALE)
            click.echo(f"wrote {write_degraded}: {DEGRADED_TENSOR} x {DEGRADED_SCALE:g}")
            return
        with tempfile.TemporaryDirectory(prefix="ds4-gate-reference-") as tmp:
            work = Path(keep_traces or tmp)
            work.mkdir(parents=True, exist_ok=True)
            if record:
                per = REFERENCE_RUNS // REFERENCE_TRACES
                traces = [work / f"reference-{i}.trace" for i in range(REFERENCE_TRACES)]
                for i, trace in enumerate(traces):
                    run_sampled(SampledRun(REFERENCE_SEED + i * per, per, model), trace)
                cmd = [str(Path(sys.executable).with_name("ds4-eval")), "reference", "record", *map(str, traces),
                       "-o", references] + (["--model", model] if model else [])
                sys.exit(subprocess.run(cmd).returncode)
            failed = []
            for i in range(trials):
                status = gate_once(seed + i * REPEATS, Path(references), model, work)
                if status == 2:
                    sys.exit(2)
                if status:
                    failed.append(seed + i * REPEATS)
            if trials > 1:
                click.echo(f"reference gate: {len(failed)}/{trials} runs failed"
                           + (f" (seeds {', '.join(map(str, failed))})" if failed else ""))
            sys.exit(1 if failed else 0)
    except (ReferenceGateError, ModelLoadError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
