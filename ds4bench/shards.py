"""`ds4-bench shards`: one suite on the engine backend, run in one process and spread over a Ray
cluster, interleaved round by round.

    ds4-bench shards --ray ADDRESS [--suite sanity] [--rounds 3] [--threads 2] [--tokens N] [--json FILE]

Each round runs `ds4-eval run --plain` twice as a child process, in an order that alternates
from round to round so that a slow phase of a shared machine falls on both paths alike:
  one process   --threads T (default: the cluster's CPU count)
  ray           --ray ADDRESS: one task a shard, one shard per CPU of the cluster
Wall time is the child's, from start to exit, so model loading, Ray's connection and task start-up
and the merge are all in it. Overhead per case is wall time minus the generation time on the run's
critical path, divided by the cases: for one process the sum of its cases' generation times, for
Ray the largest such sum over its shards (the shards run side by side). The summary gives each
path's median wall time, the median of the per-round ratio ray / one process with its lowest and
highest, the median overhead per case, and how many greedy outputs differ between the two paths
(0 expected: the same cases, the same model and settings). Only same-run ratios mean anything on a
shared machine.
It does not start a cluster (docs/recipes/ray-cluster.sh does) and measures no other backend.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import click
from tabulate import tabulate

from ds4bench.errors import RunFailure, UsageFailure
from ds4eval.atomicfile import write_text_atomic
from ds4eval.run.trace import TraceRecord, read_trace

ONE, RAY = "one process", "ray"


@dataclass(frozen=True)
class ShardsBenchConfig:
    """One `ds4-bench shards` run; each field is one command-line flag."""

    ray: str                  # --ray: the cluster's address, as ray.init takes it
    suite: str = "sanity"     # --suite
    rounds: int = 3           # --rounds: interleaved repetitions of both paths
    threads: int | None = None  # --threads: the one process's CPU threads (default: the cluster's CPUs)
    tokens: int | None = None   # --tokens: generation budget per case (default: ds4-eval's)
    json_path: str | None = None  # --json: write the samples and the summary here

    def validate(self) -> None:
        if self.rounds < 1:
            raise UsageFailure("--rounds must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise UsageFailure("--threads must be at least 1")


@dataclass(frozen=True)
class Sample:
    path: str
    round: int
    wall_s: float
    cases: int
    critical_s: float  # generation time on the critical path (see the module docstring)
    outputs: dict     # "source/id" -> greedy output

    @property
    def overhead_per_case_s(self) -> float:
        return (self.wall_s - self.critical_s) / max(self.cases, 1)


def critical_path_s(shards: list[list[TraceRecord]]) -> float:
    """The generation time the run could not have hidden: the largest per-shard sum."""
    return max((sum(r.elapsed_s for r in recs) for recs in shards), default=0.0)


def summarize(samples: list[Sample]) -> dict:
    """Medians per path, the per-round ratio ray / one process, and the outputs that differ."""
    by = {p: [s for s in samples if s.path == p] for p in (ONE, RAY)}
    ratios = [r.wall_s / o.wall_s for o, r in zip(by[ONE], by[RAY])]
    differ = sorted({k for o, r in zip(by[ONE], by[RAY]) for k in o.outputs if o.outputs[k] != r.outputs.get(k)})
    return {
        "wall_s": {p: statistics.median(s.wall_s for s in v) for p, v in by.items()},
        "overhead_per_case_s": {p: statistics.median(s.overhead_per_case_s for s in v) for p, v in by.items()},
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "outputs_differ": differ,
    }


def render(summary: dict, rounds: int) -> str:
    rows = [[p, f"{summary['wall_s'][p]:.1f}", f"{summary['overhead_per_case_s'][p] * 1000:.0f}"] for p in (ONE, RAY)]
    r = summary["ratio"]
    return (tabulate(rows, headers=["path", "wall s (median)", "overhead ms/case"]) +
            f"\nray / one process wall time: {r['median']:.2f}x (median of {rounds} rounds; "
            f"{r['min']:.2f}-{r['max']:.2f})\ngreedy outputs that differ: {len(summary['outputs_differ'])}")


def _run(args: list[str], trace: str) -> float:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ds4eval.cli", "run", "--plain", "--trace", trace, *args],
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode not in (0, 3):  # 3: some case ended ungraded, which still measures
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        raise RunFailure(f"ds4-eval run exited {done.returncode}: {tail[0]}")
    return wall


def _sample(path: str, round_: int, wall: float, trace: str, shard_traces: list[str]) -> Sample:
    records = read_trace(trace).records
    per_shard = [read_trace(p).records for p in shard_traces] if shard_traces else [records]
    return Sample(path, round_, wall, len(records), critical_path_s(per_shard),
                  {f"{r.source}/{r.id}": r.model_output for r in records})


def run_shards_bench(cfg: ShardsBenchConfig, cpus: int, report) -> list[Sample]:
    common = ["--suite", cfg.suite, *(["-n", str(cfg.tokens)] if cfg.tokens else [])]
    samples = []
    with tempfile.TemporaryDirectory(prefix="ds4bench-shards-") as tmp:
        for round_ in range(cfg.rounds):
            order = (ONE, RAY) if round_ % 2 == 0 else (RAY, ONE)
            for path in order:
                trace = os.path.join(tmp, f"{path.replace(' ', '-')}-{round_}.trace")
                if path == ONE:
                    wall = _run([*common, "--threads", str(cfg.threads or cpus)], trace)
                    shard_traces = []
                else:
                    wall = _run([*common, "--ray", cfg.ray], trace)
                    folder = trace + ".shards"
                    shard_traces = [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
                samples.append(_sample(path, round_, wall, trace, shard_traces))
                report(f"round {round_ + 1}/{cfg.rounds} {path}: {wall:.1f} s")
    return samples


def cluster_cpus(address: str) -> int:
    """The CPU count of the cluster at `address` (UsageFailure when Ray or the cluster is missing)."""
    try:
        import ray
    except ImportError:
        raise UsageFailure("needs Ray: pip install 'ds4eval[ray]'") from None
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False, configure_logging=False)
        return int(ray.cluster_resources().get("CPU", 0))
    except Exception as e:
        raise UsageFailure(f"cannot reach the Ray cluster {address!r}: {type(e).__name__}: {e}") from None
    finally:
        ray.shutdown()


@click.command("shards")
@click.option("--ray", "ray_address", required=True, metavar="ADDRESS", help="The Ray cluster (as ray.init takes it).")
@click.option("--suite", default="sanity", show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True, help="Interleaved repetitions of both paths.")
@click.option("--threads", type=int, default=None, help="CPU threads of the one process (default: the cluster's CPUs).")
@click.option("-n", "--tokens", type=int, default=None, help="Generation budget per case (default: ds4-eval's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every sample and the summary as JSON.")
def shards_command(ray_address: str, suite: str, rounds: int, threads: int | None, tokens: int | None,
                   json_path: str | None) -> int:
    """A suite in one process against the same suite spread over a Ray cluster."""
    cfg = ShardsBenchConfig(ray_address, suite, rounds, threads, tokens, json_path)
    cfg.validate()
    cpus = cluster_cpus(cfg.ray)
    click.echo(f"suite {cfg.suite}: {cfg.rounds} rounds; one process with {cfg.threads or cpus} threads against "
               f"Ray at {cfg.ray} ({cpus} CPUs); load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
               err=True)
    samples = run_shards_bench(cfg, cpus, lambda line: click.echo(line, err=True))
    summary = summarize(samples)
    click.echo(render(summary, cfg.rounds))
    if cfg.json_path:
        doc = {"config": asdict(cfg), "samples": [asdict(s) | {"overhead_per_case_s": s.overhead_per_case_s}
                                                  for s in samples], "summary": summary}
        try:
            write_text_atomic(cfg.json_path, json.dumps(doc, indent=1) + "\n")
        except OSError as e:
            raise UsageFailure(f"cannot write {cfg.json_path}: {e.strerror or e}") from None
    return 0
