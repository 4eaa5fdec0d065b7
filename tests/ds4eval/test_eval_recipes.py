"""The scaling recipes in docs/recipes/, run as far as this machine can: the Slurm array script
for real (its tasks' environment faked), the Kubernetes Indexed Job's shard contract through
`ds4-eval list`, and the HAProxy configuration checked by HAProxy itself where it is installed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4eval import cli

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"
BIN = str(Path(sys.executable).parent)


@pytest.mark.slow
@pytest.mark.model
def test_the_slurm_array_script_writes_shards_that_merge(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RUNS": str(tmp_path), "SUITE": "sanity",
           "DS4EVAL_ARGS": "--domain arithmetic -n 16", "SLURM_ARRAY_JOB_ID": "77",
           "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "1"}
    for task in ("1", "2"):  # an array submitted as --array=1-2
        done = subprocess.run(["bash", str(RECIPES / "slurm-array.sbatch")], env={**env, "SLURM_ARRAY_TASK_ID": task},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f"shard {int(task) - 1}/2" in done.stderr
    r = CliRunner().invoke(cli.main, ["merge", str(tmp_path / "77"), "-o", str(tmp_path / "run.trace")])
    assert r.exit_code == 0, r.output
    assert "merged 2 shard(s), 2 file(s): 6 cases, 6 of 6 graded" in r.output


def test_the_indexed_job_gives_every_pod_its_own_shard_and_trace(data_dir):
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((RECIPES / "k8s-indexed-job.yaml").read_text())
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["DS4EVAL_SHARD_COUNT"]) == spec["completions"]
    command = container["command"]
    assert command[:2] == ["ds4-eval", "run"] and command[command.index("--shard") + 1] == "auto"
    trace = command[command.index("--trace") + 1]
    assert "$(JOB_COMPLETION_INDEX)" in trace  # Kubernetes expands it: one trace per pod
    suite = command[command.index("--suite") + 1]
    counts = []
    for index in range(spec["completions"]):
        pod_env = {"JOB_COMPLETION_INDEX": str(index), "DS4EVAL_SHARD_COUNT": env["DS4EVAL_SHARD_COUNT"]}
        r = CliRunner().invoke(cli.main, ["list", "--suite", suite, "--shard", "auto", "--data-dir", str(data_dir)],
                               env=pod_env)
        assert r.exit_code == 0, r.output
        found = re.search(r"(\d+) of the (\d+) cases of suite \S+ in shard (\d+)/(\d+)", r.output)
        assert found and int(found[3]) == index and int(found[4]) == spec["completions"]
        counts.append((int(found[1]), int(found[2])))
    assert sum(n for n, _ in counts) == counts[0][1]  # the pods together run the suite once


def test_the_haproxy_configuration_is_valid():
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (make setup-recipes)")
    done = subprocess.run(["haproxy", "-c", "-f", str(RECIPES / "haproxy-replicas.cfg")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_ray_script_refuses_a_wrong_role():
    done = subprocess.run(["bash", str(RECIPES / "ray-cluster.sh"), "nonsense"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
