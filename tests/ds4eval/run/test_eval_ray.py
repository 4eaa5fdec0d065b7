"""`ds4-eval run --ray` on a real Ray cluster that the test starts: a head with no CPUs and two
worker nodes of one CPU each. The sanity suite is sharded over the workers on the engine backend;
one shard's worker is killed (SIGKILL) mid-run, Ray restarts its task, and the merged trace must
hold every case exactly once with the verdicts and greedy outputs of one process.

Ray's servers listen on the node's address (Ray turns 127.0.0.1 into it), so the cluster and the
driver run in a private network namespace where loopback is the only interface: nothing is
reachable from outside. The test skips where Ray (the `ray` extra) or namespaces are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

ray = pytest.importorskip("ray", reason="needs the `ray` extra (make setup-ray)")
RAY = str(Path(sys.executable).with_name("ray"))
DS4_EVAL = str(Path(sys.executable).with_name("ds4-eval"))
PORT = 26411
TOKENS = "32"


class Namespace:
    """A network namespace kept alive by a sleeping process; commands enter it with nsenter."""

    def __init__(self):
        for unshare in (["unshare", "-n"], ["unshare", "-rn"]):
            if shutil.which("unshare") is None or shutil.which("nsenter") is None:
                break
            holder = subprocess.Popen([*unshare, "sleep", "3600"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            time.sleep(0.3)
            if holder.poll() is None and self._enter(holder.pid, ["ip", "link", "set", "lo", "up"]) == 0:
                self.holder = holder
                return
            holder.kill()
            holder.wait()
        pytest.skip("needs a private network namespace (unshare -n and nsenter) for Ray's servers")

    @staticmethod
    def _enter(pid: int, args: list[str]) -> int:
        return subprocess.call(["nsenter", "-t", str(pid), "-n", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)

    def command(self, args: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", *args]

    def processes(self) -> list[int]:
        """Every process in the namespace but its holder."""
        mine = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == mine:
                        found.append(int(entry))
                except OSError:
                    pass
        return found

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.processes():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        self.holder.kill()
        self.holder.wait()


@pytest.fixture(scope="module")
def cluster():
    ns = Namespace()
    temp = tempfile.mkdtemp(prefix="ds4ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--object-store-memory", "80000000", "--temp-dir", temp]
    try:
        subprocess.run(ns.command([RAY, "start", "--head", "--port", str(PORT), "--num-cpus", "0",
                                   "--include-dashboard", "false", "--disable-usage-stats", *common]),
                       check=True, env=env, capture_output=True, timeout=120)
        for _ in range(2):
            subprocess.run(ns.command([RAY, "start", "--address", f"127.0.0.1:{PORT}", "--num-cpus", "1",
                                       *common[:2]]), check=True, env=env, capture_output=True, timeout=120)
        yield ns, env
    finally:
        ns.close()
        shutil.rmtree(temp, ignore_errors=True)


def records_of(path):
    from ds4eval.run.trace import read_trace

    return read_trace(path).records


def test_a_sharded_run_with_a_killed_worker_matches_one_process(cluster, tmp_path):
    ns, env = cluster
    single = tmp_path / "single.trace"
    subprocess.run([DS4_EVAL, "run", "--plain", "-n", TOKENS, "--trace", str(single)], check=True,
                   capture_output=True, env=env, timeout=600)
    ray_trace = tmp_path / "ray.trace"
    driver = subprocess.Popen(ns.command([DS4_EVAL, "run", "--plain", "-n", TOKENS, "--ray", f"127.0.0.1:{PORT}",
                                          "--trace", str(ray_trace)]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    shard_dir = Path(str(ray_trace) + ".shards")
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and driver.poll() is None and time.monotonic() < deadline:
        finished = sum(p.read_text().count("%%case ") for p in shard_dir.glob("*.trace")) if shard_dir.exists() else 0
        tasks = subprocess.run(["pgrep", "-f", "ray::run_shard"], capture_output=True, text=True).stdout.split()
        if finished >= 4 and tasks:
            killed = int(tasks[0])
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.1)
    out, _ = driver.communicate(timeout=600)
    assert killed is not None, f"the run ended before a worker could be killed:\n{out}"
    assert driver.returncode == 0, out
    assert "shard task(s) restarted after their worker died" in out

    one, spread = records_of(single), records_of(ray_trace)
    keys = [(r.source, r.id) for r in spread]
    assert len(keys) == len(set(keys)) == len(one) == 41  # every case exactly once
    expected = {(r.source, r.id): (r.index, r.status, r.picked, r.model_output) for r in one}
    assert {(r.source, r.id): (r.index, r.status, r.picked, r.model_output) for r in spread} == expected
    # The restarted shard ran only what its dead worker had not finished: no case was run twice.
    in_shards = [(r.source, r.id) for p in shard_dir.glob("*.trace") for r in records_of(p)]
    assert sorted(in_shards) == sorted(keys)
