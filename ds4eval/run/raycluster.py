"""Ray as the engine that spreads one run over a cluster: `ds4-eval run --ray [ADDRESS]`.

Contract
- `run_on_ray(cfg, selected, echo) -> RayOutcome` splits the selection into shards
  (`ds4eval.run.shards`) and runs each shard as one Ray task, with the ordinary runner and backend
  inside it:
  - engine backend on CUDA: `num_gpus=1` a task, one shard per GPU of the cluster;
  - engine backend on CPU: `num_cpus=C` a task (C = --threads, else 1), one shard per C CPUs;
  - server backends: `num_cpus=1` a task, one shard per CPU, each keeping --concurrency requests
    in flight, so that the requests are spread over the cluster's machines.
  --ray-shards N overrides the count (more shards than slots: Ray queues them).
- A task sends each finished case's trace block to one collector actor pinned to the driver's
  node, which appends it to that shard's trace in `<--trace>.shards/` and fsyncs it. A shard's
  finished cases therefore outlive the worker that ran them.
- Ray re-runs a task whose worker or node died (`max_retries`). A task, the first time or again,
  starts by asking the collector which of its cases did not finish PASSED or FAILED and runs only
  those (the semantics of `ds4-eval retry`), so a case finished before the death is not run
  again. A late block of a case that did run twice is superseded, never counted twice: the merge
  keeps the latest block of each case and repeat.
- The same holds across driver runs: run the same command again and it resumes from the shard
  traces it finds (refusing a folder that holds another run's shards).
- The driver prints one line per finished case (no terminal UI: cases finish on other machines),
  then merges the shard traces (`ds4eval.run.merge`), appends the merged run to --trace and
  returns the run's states for the usual report and exit status. SIGINT/SIGTERM cancel the tasks
  and still merge what finished.
It places, retries and moves nothing itself: Ray does (tasks, retries, actor calls). `ray` is an
optional dependency (the `ray` extra), imported only here and only when --ray is given.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from ds4eval.cases.case import Case
from ds4eval.config import EvalConfig
from ds4eval.run import merge as mg
from ds4eval.run import shards
from ds4eval.run.runner import CaseState, Runner, Status
from ds4eval.run.trace import (RunHeader, TraceRecord, TraceWriter, format_record, format_run_header,
                               parse_trace_bytes)

MAX_RETRIES = 3      # re-runs of a shard whose worker died, on top of the first attempt
POLL_S = 0.5         # how often the driver asks the collector for finished cases


class RayUnavailable(RuntimeError):
    """Ray is not installed or the cluster cannot be reached; the message is one line."""


def shard_dir(trace: str) -> str:
    """Where a run with --trace TRACE keeps its shard traces."""
    return trace + ".shards"


def shard_path(directory: str, shard: shards.Shard) -> str:
    return os.path.join(directory, f"shard-{shard.index:04d}-of-{shard.count:04d}.trace")


# ---------------------------------------------------------------- what a task runs

@dataclass(frozen=True)
class Slots:
    """What one task asks Ray for, and how many shards the cluster runs at once."""

    num_cpus: float
    num_gpus: float
    shards: int


def plan_slots(cfg: EvalConfig, resources: dict) -> Slots:
    """Task resources and the shard count for `cfg` on a cluster with `resources` (Ray's
    cluster_resources()). Raises RayUnavailable when the cluster has nothing a task could run on."""
    if cfg.backend == "engine" and cfg.device.startswith("cuda"):
        gpus = int(resources.get("GPU", 0))
        if gpus < 1 and cfg.ray_shards is None:
            raise RayUnavailable("--device cuda on Ray: the cluster has no GPU")
        return Slots(1, 1, cfg.ray_shards or gpus)
    per_task = float(cfg.threads or 1) if cfg.backend == "engine" else 1.0
    cpus = int(resources.get("CPU", 0) // per_task)
    if cpus < 1 and cfg.ray_shards is None:
        raise RayUnavailable(f"the Ray cluster has no {per_task:g} free CPU(s) for a task")
    return Slots(per_task, 0, cfg.ray_shards or cpus)


class _CollectorSink:
    """The runner's trace, as a task sees it: blocks go to the collector actor, in order."""

    def __init__(self, collector, index: int):
        self.collector, self.index = collector, index

    def write_header(self, header: RunHeader) -> None:
        self.collector.append.remote(self.index, format_run_header(header))

    def write(self, rec: TraceRecord) -> None:
        self.collector.append.remote(self.index, format_record(rec))

    def close(self) -> None:
        import ray

        ray.get(self.collector.flush.remote())  # every block this task sent is on disk


def run_shard(cfg: EvalConfig, part: shards.ShardPart, collector) -> dict:
    """Body of one Ray task: the unfinished cases of `part`, through the ordinary runner."""
    import ray

    from ds4eval.run.backends import create_backend

    todo = ray.get(collector.unfinished.remote(part.shard.index))
    collector.started.remote(part.shard.index, os.getpid())
    if todo is None:  # a first attempt: the whole shard, every repeat
        cases, numbers, repeats = part.cases, part.numbers, None
    else:
        by_key = {(c.source, c.id): (c, n) for c, n in zip(part.cases, part.numbers)}
        todo = [(s, i, r) for s, i, r in todo if (s, i) in by_key]
        cases = [by_key[(s, i)][0] for s, i, _ in todo]
        numbers = [by_key[(s, i)][1] for s, i, _ in todo]
        repeats = [r for _, _, r in todo]
    if not cases:
        return {"shard": str(part.shard), "ran": 0}
    backend = create_backend(cfg)
    try:
        runner = Runner(cfg, cases, backend, numbers=numbers, repeats=repeats, shard_header=part.header_fields(),
                        trace_sink=_CollectorSink(collector, part.shard.index))
        states = runner.run()
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return {"shard": str(part.shard), "ran": len(states)}


class TraceCollector:
    """The Ray actor that owns the shard traces on the driver's node (see the module docstring)."""

    def __init__(self, directory: str, count: int):
        self.directory, self.count = directory, count
        self.writers: dict[int, TraceWriter] = {}
        self.finished: list[tuple[int, str]] = []  # (shard index, block text) in arrival order
        self.pids: dict[int, list[int]] = {}

    def path(self, index: int) -> str:
        return shard_path(self.directory, shards.Shard(index, self.count))

    def unfinished(self, index: int) -> list[tuple[str, str, int]] | None:
        """The shard's (source, id, repeat) that did not finish graded; None when it never started."""
        from ds4eval.verdict.regrade import incomplete

        path = self.path(index)
        if not os.path.exists(path):
            return None
        self.close_writer(index)  # the shard's last writer is gone: read what reached the disk
        with open(path, "rb") as f:
            parsed = parse_trace_bytes(f.read())
        return incomplete(parsed.records, parsed.runs)

    def started(self, index: int, pid: int) -> None:
        self.pids.setdefault(index, []).append(pid)

    def append(self, index: int, block: str) -> None:
        if index not in self.writers:
            self.writers[index] = TraceWriter(self.path(index))
        self.writers[index].append_block(block)
        if not block.startswith("%%run"):
            self.finished.append((index, block))

    def flush(self) -> bool:
        return True  # actor calls run in order: every append sent before this one is written

    def close_writer(self, index: int) -> None:
        writer = self.writers.pop(index, None)
        if writer is not None:
            writer.close()

    def progress(self, cursor: int) -> tuple[list[tuple[int, str]], dict[int, list[int]]]:
        """Blocks finished since `cursor` (an index into the arrival order), and each shard's task pids."""
        return self.finished[cursor:], self.pids

    def close(self) -> None:
        for index in list(self.writers):
            self.close_writer(index)


# ---------------------------------------------------------------- the driver

@dataclass
class RayOutcome:
    states: list[CaseState]
    wall_s: float
    interrupted: bool
    merged: mg.Merged | None
    failures: list[str]          # shards whose task failed for good, with why
    shards: int


def check_shard_dir(directory: str, parts: list[shards.ShardPart]) -> None:
    """RayUnavailable when `directory` holds shard traces of another run than `parts`."""
    if not os.path.isdir(directory):
        return
    mine = {os.path.basename(shard_path(directory, p.shard)) for p in parts}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name not in mine:
            raise RayUnavailable(f"{path}: not a shard of this run (another shard count?); remove {directory} "
                                 f"or use another --trace")
        with open(path, "rb") as f:
            runs = parse_trace_bytes(f.read()).runs
        if runs and runs[0].selection != parts[0].selection:
            raise RayUnavailable(f"{path}: holds another selection's shard; remove {directory} or use another "
                                 f"--trace")


def states_of(records: list[TraceRecord], cases: dict[tuple[str, str], Case],
              header: RunHeader) -> list[CaseState]:
    """The run's case states rebuilt from its merged trace: one per selected case and repeat."""
    latest = {(r.source, r.id, r.repeat): r for r in records}
    states = []
    for number, source, case_id in header.cases:
        for repeat in range(header.repeats):
            rec = latest.get((source, case_id, repeat))
            st = CaseState(index=len(states), number=number, case=cases[(source, case_id)], repeat=repeat)
            if rec is not None:
                st.status = Status(rec.status) if rec.status in Status.__members__ else Status.ERROR
                st.picked, st.error, st.output = rec.picked, rec.error, rec.model_output
                st.prompt_tokens, st.gen_tokens, st.elapsed_s = rec.prompt_tokens, rec.gen_tokens, rec.elapsed_s
                st.think_close, st.thinking, st.runs = rec.think_close, rec.thinking, 1
                st.latency = rec.latency()
            states.append(st)
    return states


def run_on_ray(cfg: EvalConfig, selected: list[Case], echo: Callable[[str], None]) -> RayOutcome:
    """Run `selected` over the Ray cluster at cfg.ray (see the module docstring)."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'ds4eval[ray]'") from None
    start = time.monotonic()
    try:
        ray.init(address=cfg.ray or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except Exception as e:  # Ray raises many kinds for an unreachable cluster; one line each
        raise RayUnavailable(f"cannot reach the Ray cluster {cfg.ray or '(local)'}: {type(e).__name__}: {e}") from None
    try:
        slots = plan_slots(cfg, ray.cluster_resources())
        filters = shards.filters_json(cfg.case_ids, cfg.domains, cfg.sources)
        parts = [shards.part(selected, shards.Shard(i, slots.shards), cfg.repeats, filters)
                 for i in range(slots.shards)]
        # Absolute: the collector actor does not run in this process's working directory.
        directory = shard_dir(os.path.abspath(cfg.trace))
        check_shard_dir(directory, parts)
        os.makedirs(directory, exist_ok=True)
        echo(f"ray: {len(selected)} cases in {slots.shards} shards, {slots.num_cpus:g} CPU and "
             f"{slots.num_gpus:g} GPU a task; shard traces in {directory}")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        collector = ray.remote(TraceCollector).options(num_cpus=0, scheduling_strategy=here).remote(
            directory, slots.shards)
        # The workers run one case at a time per task unless --parallel/--concurrency say otherwise;
        # their thread count is the task's CPU share.
        task_cfg = replace(cfg, trace=None, summary=None, report=None, plain=True, ray=None,
                           threads=int(slots.num_cpus) if cfg.backend == "engine" and not slots.num_gpus else cfg.threads)
        task = ray.remote(run_shard).options(num_cpus=slots.num_cpus, num_gpus=slots.num_gpus,
                                             max_retries=MAX_RETRIES, retry_exceptions=False)
        pending = {task.remote(task_cfg, p, collector): p for p in parts if p.cases}
        failures, interrupted = _wait(ray, pending, collector, len(selected) * cfg.repeats, echo)
        ray.get(collector.close.remote())
    finally:
        ray.shutdown()
    paths = [shard_path(directory, p.shard) for p in parts]
    present = [p for p in paths if os.path.exists(p)]
    merged = None
    if present:
        try:
            merged = mg.merge([mg.ShardTrace(p, _read(p)) for p in present])
        except mg.MergeRefused as e:
            failures += e.problems
    if merged is not None:
        with TraceWriter(cfg.trace) as out:
            out.append_block(merged.text())
    # A merge covers the whole selection or is refused; without one every case counts as not run
    # (the shard traces stay, and the same command resumes from them).
    header = RunHeader(cfg.suite, tuple((n, c.source, c.id) for n, c in enumerate(selected, 1)), cfg.repeats)
    states = states_of(merged.records if merged else [], {(c.source, c.id): c for c in selected}, header)
    return RayOutcome(states, time.monotonic() - start, interrupted, merged, failures, slots.shards)


def _read(path: str):
    with open(path, "rb") as f:
        return parse_trace_bytes(f.read())


def _wait(ray, pending: dict, collector, total: int, echo: Callable[[str], None]) -> tuple[list[str], bool]:
    """Wait for every task, echoing each finished case; (failures, interrupted)."""
    from ds4eval.run.stopsignals import StopSignals

    failures, cursor, done, deaths = [], 0, 0, 0
    with StopSignals() as signals:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                part = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as e:  # the task failed for good, its retries spent
                    failures.append(f"shard {part.shard}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            blocks, pids = ray.get(collector.progress.remote(cursor))
            cursor += len(blocks)
            for index, block in blocks:
                done += 1
                rec = parse_trace_bytes(block.encode()).records
                if rec:
                    r = rec[0]
                    echo(f"[{done}/{total}] {r.status} {r.source}/{r.id}"
                         f"{f' repeat {r.repeat}' if r.repeat else ''} (shard {index}, {r.gen_tokens} tokens, "
                         f"{r.elapsed_s:.1f} s)")
            restarted = sum(len(v) - 1 for v in pids.values())
            if restarted > deaths:
                echo(f"ray: {restarted - deaths} shard task(s) restarted after their worker died")
                deaths = restarted
            if signals.fired is not None:
                echo("ray: stopping: cancelling the shard tasks")
                for ref in pending:
                    ray.cancel(ref, force=True)
                return failures, True
    return failures, False
