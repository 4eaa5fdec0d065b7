"""Speed gate: the working tree's engine against BASE's, measured interleaved in one run.

    python -m quality_testing.gate_speed --base HEAD~1 [--threshold 0.10] [--repeats 5]

1. BASE is resolved to a commit and its tree is extracted into a temporary directory with
   `git archive` (its own checkout of the ref; the repository, its index and its worktree
   list are never touched, so an interrupted gate leaves nothing behind).
2. When that tree has no engine (`engine/__init__.py` exporting `load_model`), there is
   nothing to compare: the gate says so and passes.
3. Two workers (quality_testing/speed_worker.py, run by path) load the engine of BASE and
   of the working tree on the same GGUF; the venv is shared, only the source tree differs.
   Then, `repeats` times, each is asked to measure once (best of `trials` short trials),
   alternating which goes first, so that the slow phases of a shared machine fall on both alike.
4. Per metric (prefill and decode tokens/s) the median over repetitions of the paired
   ratio, working tree / BASE within one repetition, is printed with every measurement;
   the gate fails (exit 1) when it is below 1 - threshold. Pairs measured back to back
   share the host's slow phases, so a neighbour's burst of a few seconds moves a pair's two
   sides alike, where it could move one side's median alone. A failing comparison is
   printed and measured once more with fresh workers; the second is the verdict (a real
   slowdown fails both). Absolute speeds are shown but never judged: on a shared machine
   only same-run ratios mean anything.
5. The product paths: `ds4-bench product` (ds4bench/product.py) runs in a subprocess on
   the working tree and measures, interleaved in one process, the engine's raw decode, the
   ds4-eval engine backend and a ds4-server single stream (and N streams with
   `--batched-session N`); the gate prints its table and fails when a single-stream product
   path decodes below `--product-floor` (default 0.9) times the raw engine, because that is the
   speed users get, or spends more than `--product-own-max` (default 0.05) of the engine's time
   per token on its own work outside the network's decode step: a share taken within each
   measurement, so that it does not move with the host the way the rate ratio does, and that
   catches a costlier job loop which the ratio's noise would hide (`ds4bench.product`'s
   `own_work_shares`; judged only where the steps are timed one per token, on the CPU). A run
   that fails either is printed and measured once more in a fresh process; the second run is
   the verdict. `--product-floor 0` leaves this step out, `--product-own-max 0` the share.
It does not build anything beyond extracting sources (the engine is pure Python on torch).
"""
from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
import click
from tabulate import tabulate

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "speed_worker.py"
METRICS = ("prefill_tps", "decode_tps")


class GateError(RuntimeError):
    """The gate could not run (bad ref, a worker that failed); the message says why."""


@dataclass(frozen=True)
class SpeedGateConfig:
    """One speed-gate run; each field is one command-line flag."""

    base: str = "HEAD~1"  # git ref to compare against
    threshold: float = 0.10  # fail when a median ratio is below 1 - threshold
    repeats: int = 5  # measurements per side, interleaved
    trials: int = 3  # trials per measurement; the fastest counts (contention only slows)
    prefill_tokens: int = 128  # prompt length of the prefill measurement
    decode_context: int = 16  # context before the decode measurement
    decode_tokens: int = 32  # tokens per decode measurement
    model: str | None = None  # GGUF; None: the embedded model
    product_floor: float = 0.90  # fail when a product path decodes below this times the engine; 0: skip
    product_own_max: float = 0.05  # fail when a product path's own work exceeds this of a token; 0: skip
    product_rounds: int = 3  # interleaved rounds of the product measurement
    product_tokens: int = 128  # tokens per product measurement
    product_streams: int = 8  # streams of the batched-server product path (0: left out)


@dataclass(frozen=True)
class GateResult:
    base_sha: str
    samples: dict[str, list[dict[str, float]]]  # "base" / "work" -> one dict per repetition
    ratios: dict[str, float]  # metric -> median over repetitions of work / base
    failed: tuple[str, ...]  # metrics below the threshold


def _git(*args: str) -> bytes:
    p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True)
    if p.returncode != 0:
        raise GateError(f"git {' '.join(args)}: {p.stderr.decode(errors='replace').strip()}")
    return p.stdout


def extract_tree(sha: str, dest: Path) -> None:
    """BASE's files into dest, read from git's object store (no worktree, no index change)."""
    data = _git("archive", "--format=tar", sha)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def has_engine(root: Path) -> bool:
    init = root / "engine" / "__init__.py"
    return init.is_file() and "load_model" in init.read_text(encoding="utf-8", errors="replace")


def judge(samples: dict[str, list[dict[str, float]]], threshold: float) -> tuple[dict[str, float], tuple[str, ...]]:
    """Per metric, the median over repetitions of working tree / BASE measured in the same
    repetition, and the metrics whose median falls below 1 - threshold. Pure."""
    if len(samples["base"]) != len(samples["work"]) or not samples["base"]:
        raise ValueError("judge needs one BASE and one working-tree sample per repetition")
    ratios = {m: statistics.median(w[m] / b[m] for b, w in zip(samples["base"], samples["work"]))
              for m in METRICS}
    return ratios, tuple(m for m in METRICS if ratios[m] < 1.0 - threshold)


class Worker:
    def __init__(self, label: str, root: Path, cfg: SpeedGateConfig, model: str):
        self.label = label
        cmd = [sys.executable, str(WORKER), "--root", str(root), "--model", model,
               "--prefill", str(cfg.prefill_tokens), "--ctx", str(cfg.decode_context), "--decode", str(cfg.decode_tokens),
               "--trials", str(cfg.trials)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=tempfile.gettempdir())

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip().splitlines()
            raise GateError(f"the {self.label} engine's worker stopped: {err[-1] if err else 'no output'}")
        return json.loads(line)

    def ready(self) -> float:
        return float(self._read()["load_s"])

    def measure(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def run_gate(cfg: SpeedGateConfig, echo=click.echo) -> GateResult | None:
    """The measured result, or None when BASE has no engine to compare with."""
    from engine import default_model_path

    if cfg.repeats < 1 or cfg.trials < 1 or not 0 < cfg.threshold < 1:
        raise GateError("--repeats and --trials must be >= 1 and --threshold in (0, 1)")
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{cfg.base}^{{commit}}").decode().strip()
    except GateError:
        raise GateError(f"{cfg.base!r} is not a commit of this repository") from None
    model = cfg.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="ds4-gate-speed-") as tmp:
        base_root = Path(tmp)
        extract_tree(sha, base_root)
        if not has_engine(base_root):
            echo(f"BASE {cfg.base} ({sha[:12]}) has no engine yet: nothing to compare, speed gate passes")
            return None
        workers = {"base": Worker("BASE", base_root, cfg, model), "work": Worker("working tree", REPO, cfg, model)}
        try:
            for label, w in workers.items():
                echo(f"{label:<5} engine loaded in {w.ready():.1f} s")
            samples: dict[str, list[dict[str, float]]] = {"base": [], "work": []}
            for r in range(cfg.repeats):
                order = ("base", "work") if r % 2 == 0 else ("work", "base")
                for label in order:
                    s = workers[label].measure()
                    samples[label].append(s)
                    echo(f"[{r}] {label:<5} prefill {s['prefill_tps']:8.1f} tok/s  decode {s['decode_tps']:7.1f} tok/s")
        finally:
            for w in workers.values():
                w.close()
    ratios, failed = judge(samples, cfg.threshold)
    return GateResult(sha, samples, ratios, failed)


@dataclass(frozen=True)
class ProductResult:
    table: str
    failures: tuple[str, ...]


def run_product(cfg: SpeedGateConfig, echo=click.echo) -> ProductResult:
    """`ds4-bench product` on the working tree, in its own process; its progress goes to stderr."""
    from ds4bench import product as pb

    with tempfile.TemporaryDirectory(prefix="ds4-gate-product-") as tmp:
        out = Path(tmp) / "product.json"
        cmd = [sys.executable, "-m", "ds4bench.cli", "product", "--json", str(out),
               "--rounds", str(cfg.product_rounds), "--decode-tokens", str(cfg.product_tokens),
               "--streams", str(cfg.product_streams)] + (["--model", cfg.model] if cfg.model else [])
        echo(f"product paths: {' '.join(cmd[1:])}")
        p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
        if p.returncode != 0 or not out.is_file():
            raise GateError(f"ds4-bench product failed (exit {p.returncode})")
        doc = json.loads(out.read_text(encoding="utf-8"))
    summary = [pb.PathSummary(**row) for row in doc["summary"]]
    own = pb.own_work_failures(summary, cfg.product_own_max) if cfg.product_own_max > 0 else []
    return ProductResult(pb.render_table(summary, cfg.product_rounds),
                         tuple(pb.product_failures(summary, cfg.product_floor)) + tuple(own))


def render(res: GateResult, cfg: SpeedGateConfig) -> str:
    rows = []
    for m in METRICS:
        b = [s[m] for s in res.samples["base"]]
        w = [s[m] for s in res.samples["work"]]
        rows.append([m.replace("_tps", ""), f"{statistics.median(b):.1f}", f"{statistics.median(w):.1f}",
                     f"{res.ratios[m]:.3f}", "FAIL" if m in res.failed else "ok"])
    head = (f"speed gate: working tree vs {cfg.base} ({res.base_sha[:12]}), {cfg.repeats} interleaved repetitions, "
            f"best of {cfg.trials} trials each, fail below {1 - cfg.threshold:.2f}")
    return head + "\n" + tabulate(rows, headers=["metric", "BASE tok/s", "work tok/s", "paired ratio", "status"],
                                  disable_numparse=True)


@click.command()
@click.option("--base", required=True, help="Git ref to compare against (e.g. HEAD~1, main).")
@click.option("--threshold", type=float, default=0.10, show_default=True,
              help="Fail when the working tree's speed, as a median of paired ratios to BASE's, is more than "
                   "this fraction below 1.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Measurements per side, interleaved.")
@click.option("--trials", type=int, default=3, show_default=True,
              help="Trials per measurement; the fastest counts.")
@click.option("--prefill-tokens", type=int, default=128, show_default=True, help="Prefill measurement length.")
@click.option("--decode-context", type=int, default=16, show_default=True, help="Context before decoding.")
@click.option("--decode-tokens", type=int, default=32, show_default=True, help="Tokens per decode measurement.")
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--product-floor", type=float, default=0.90, show_default=True,
              help="Fail when ds4-eval or a ds4-server stream decodes below this times the raw engine (0: skip).")
@click.option("--product-own-max", type=float, default=0.05, show_default=True,
              help="Fail when ds4-eval or a ds4-server stream spends more than this fraction of the engine's "
                   "time per token on its own work outside the decode step (0: skip).")
@click.option("--product-rounds", type=int, default=3, show_default=True, help="Rounds of the product measurement.")
@click.option("--product-tokens", type=int, default=128, show_default=True, help="Tokens per product measurement.")
@click.option("--product-streams", type=int, default=8, show_default=True,
              help="Streams of the batched-server product path (0: left out).")
def main(base, threshold, repeats, trials, prefill_tokens, decode_context, decode_tokens, model,
         product_floor, product_own_max, product_rounds, product_tokens, product_streams) -> None:
    """Fail when the working tree's engine is slower than BASE's beyond the threshold, or when
    the product paths are slower than the engine itself."""
    cfg = SpeedGateConfig(base=base, threshold=threshold, repeats=repeats, trials=trials, prefill_tokens=prefill_tokens,
                          decode_context=decode_context, decode_tokens=decode_tokens, model=model,
                          product_floor=product_floor, product_own_max=product_own_max,
                          product_rounds=product_rounds, product_tokens=product_tokens, product_streams=product_streams)
    t0 = time.perf_counter()
    if not 0 <= cfg.product_floor < 1:
        click.echo("error: --product-floor must be in [0, 1)", err=True)
        sys.exit(2)
    if not 0 <= cfg.product_own_max < 1:
        click.echo("error: --product-own-max must be in [0, 1)", err=True)
        sys.exit(2)
    try:
        res = run_gate(cfg)
        if res is not None and res.failed:
            # Measured once more with fresh workers, as the product step below: a real
            # slowdown fails both runs, a slow moment of a shared host rarely does.
            click.echo(render(res, cfg))
            click.echo(f"first run failed ({', '.join(res.failed)}): measured again")
            res = run_gate(cfg)
        if res is not None:
            click.echo(render(res, cfg))
        product = run_product(cfg) if cfg.product_floor > 0 else None
        if product is not None and product.failures:
            # A failing run is measured once more, in a fresh process, and that run is the
            # verdict: on a shared host one run's rounds can all land on a slow moment, and a
            # real slowdown fails both runs.
            click.echo("product paths, first run (failed: measured again):")
            click.echo(product.table)
            for line in product.failures:
                click.echo(f"failed in the first run: {line}")
            product = run_product(cfg)
    except (GateError, OSError, tarfile.TarError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    failed = bool(res is not None and res.failed)
    if product is not None:
        own = f", or own work above {cfg.product_own_max:.1%} of a token" if cfg.product_own_max > 0 else ""
        click.echo(f"product paths against the raw engine, fail below {cfg.product_floor:.2f}x{own}:")
        click.echo(product.table)
        for line in product.failures:
            click.echo(f"FAIL: {line}")
        failed = failed or bool(product.failures)
    click.echo(f"({time.perf_counter() - t0:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
