"""Benchmark (pytest-benchmark, `make bench`): reading a 200 MB hostile trace, one in which every
block's `chars=` count is wrong (far past the end of the file), so that no block is read by the
fast path and every one is reported and skipped. The output text holds a character outside the
Basic Multilingual Plane, which makes Python hold decoded text at four bytes a character.

The target is under 10 s and under 1 GB of memory; both are measured, not asserted: the time by
pytest-benchmark, the peak memory (VmHWM) of a separate process that only reads the trace,
printed with `-s`. Without DS4_BENCH=1 it is skipped: writing the file alone takes seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds4eval.run import trace as tr

TARGET_BYTES = 200 * 10**6
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not os.environ.get("DS4_BENCH"), reason="writes a 200 MB trace: DS4_BENCH=1 (make bench)")


def hostile_block(i: int) -> str:
    rec = tr.TraceRecord(index=i, source="bench", id=f"case-{i}", status="PASSED", picked="4", expected="4",
                         answer_kind="integer", system_prompt="You are a careful problem solver.",
                         question_prompt="What is it? " * 40, rendered_prompt="<|im_start|>user\n" + "x" * 600,
                         model_output="Let me think about it \U0001F600 carefully.\n" * 300 + "Answer: 4")
    return re.sub(r"chars=\d+", f"chars={10**9 + i}", tr.format_record(rec))


@pytest.fixture(scope="module")
def hostile_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "hostile.trace"
    n = TARGET_BYTES // len(hostile_block(1).encode()) + 1
    with open(path, "w", encoding="utf-8", newline="") as f:
        for i in range(1, n + 1):
            f.write(hostile_block(i))
    return path


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec.
PEAK = textwrap.dedent("""
    import sys
    from ds4eval.run import trace

    def peak_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    before = peak_kib()
    parsed = trace.read_trace(sys.argv[1])
    print(len(parsed.records), len(parsed.problems), before // 1024, peak_kib() // 1024)
""")


def test_read_a_200_mb_trace_whose_every_count_is_wrong(benchmark, hostile_trace):
    parsed = benchmark.pedantic(tr.read_trace, args=(hostile_trace,), rounds=3, iterations=1)
    blocks = hostile_trace.read_bytes().count(b"%%case ")
    assert parsed.records == [] and len(parsed.problems) == blocks
    assert parsed.problems[-1].startswith("line ") and f"case-{blocks}" in parsed.problems[-1]
    done = subprocess.run([sys.executable, "-c", PEAK, str(hostile_trace)], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True)
    records, problems, before_mib, peak_mib = map(int, done.stdout.split())
    size_mb = hostile_trace.stat().st_size / 10**6
    print(f"\nhostile trace: {size_mb:.0f} MB, {blocks} blocks, {problems} skipped; peak memory of a process "
          f"reading it {peak_mib} MiB ({before_mib} MiB before reading)")
