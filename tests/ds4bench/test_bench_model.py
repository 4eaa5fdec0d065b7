"""`ds4-bench engine --quick` end to end on the embedded model, as a user runs it."""
from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys

import pytest

from ds4bench import engine_bench as eb


def run_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4bench.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def read_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.model
def test_quick_run_on_the_embedded_model(tmp_path):
    from engine import kernels

    out = tmp_path / "quick.csv"
    path = kernels.host_paths()[0]  # named, so the run says it was named
    p = run_bench("engine", "--quick", "--repeats", "1", "--cpu-kernels", path, "--csv", str(out))
    assert p.returncode == 0, p.stderr
    assert "decode 16 after 128" in p.stdout and "ds4 load" in p.stdout
    assert f"ds4 kernels: {path} (named by the caller)" in p.stderr
    rows = read_rows(out)
    plan = eb.plan_steps(eb.EngineBenchConfig(quick=True))
    assert len(rows) == 1 + sum(s.timed_prefill + s.decode_after for s in plan)
    assert {r["model"] for r in rows} == {"SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert {(r["engine"], r["device"], r["weights"]) for r in rows} == {("ds4", "cpu", "packed")}
    for r in rows:
        assert float(r["seconds"]) > 0
        if r["metric"] != "load":
            n = int(r["n_decode"] if r["metric"] == "decode" else r["n_prompt"])
            assert float(r["tokens_per_s"]) == pytest.approx(n / float(r["seconds"]), rel=1e-3)


# Slow: test_quick_run_on_the_embedded_model runs the command, test_bench_engine's fake runners
# the --compare rounds and table, test_llama_cpp_runner_reads_the_frontier_logits llama.cpp's side.
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (extra 'llamacpp') missing")
def test_quick_side_by_side_with_llama_cpp(tmp_path):
    out = tmp_path / "compare.csv"
    p = run_bench("engine", "--quick", "--repeats", "1", "--compare", "llama.cpp", "--csv", str(out))
    assert p.returncode == 0, p.stderr
    assert "ds4/llama.cpp" in p.stdout
    rows = read_rows(out)
    assert [r["engine"] for r in rows if r["metric"] == "load"] == ["ds4", "llama.cpp"]
    by_engine = {e: [(r["metric"], r["n_prompt"], r["n_decode"]) for r in rows if r["engine"] == e]
                 for e in ("ds4", "llama.cpp")}
    assert by_engine["ds4"] == by_engine["llama.cpp"]


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (extra 'llamacpp') missing")
def test_llama_cpp_runner_reads_the_frontier_logits():
    """A wrong logits row would decode unrelated tokens at full speed and go unnoticed in a benchmark."""
    import numpy as np
    from engine import default_model_path

    from ds4bench.runners import Ds4Runner, LlamaCppRunner

    path = default_model_path()
    ours, theirs = Ds4Runner(path, ctx=256), LlamaCppRunner(path, ctx=256, threads=2)
    ours.load()
    theirs.load()
    try:
        model = ours._model
        ids = model.prompt_ids(model.tokenize(model.render_chat([{"role": "user", "content": "What is the capital of France?"}]), special=True))
        ours.prefill(ids)
        theirs.prefill(ids)
        mine, other = ours._session.logits.numpy(), theirs.last_logits().copy()
        # Same weights, different kernels (llama.cpp quantizes activations): near-identical, not equal.
        assert np.corrcoef(mine, other)[0, 1] > 0.99
        banned = frozenset(model.eos_ids)
        masked = other.copy()
        masked[sorted(banned)] = -np.inf
        assert theirs.decode(2, banned)[0] == int(np.argmax(masked))
        assert ours.decode(2, banned)[0] == int(np.argmax(np.where(np.isin(np.arange(len(mine)), sorted(banned)),
                                                                   -np.inf, mine)))
    finally:
        ours.close()
        theirs.close()


@pytest.mark.model
def test_a_cpu_kernel_path_this_cpu_lacks_is_a_one_line_usage_error():
    from engine import kernels

    lacking = [p for p in kernels.PATHS if p not in kernels.host_paths()]
    if not lacking:
        pytest.skip("this CPU runs every path")
    p = run_bench("engine", "--quick", "--repeats", "1", "--cpu-kernels", lacking[0])
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"CPU kernels {lacking[0]!r} need" in p.stderr
