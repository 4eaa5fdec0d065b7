"""`python tests/server/measure_fair_latency.py [--repo DIR] [--n 128] [--max-tokens 16] [--batched-session N]`:
issue 42's fairness target on the embedded model: a normal request's latency while one request of
`--n` choices runs, as a ratio to its idle latency.

It starts `python -m server.cli` (the embedded model) from `--repo` (default: this checkout; give
another checkout to measure the code before a change), sends the normal request three times alone
(the best time is the idle latency), then the many-choice request from a thread, waits until
`/health` says the worker is busy, and times the normal request again. Both are greedy
`/v1/completions` with different prompts. It prints the figures and the ratio. A measurement, not a
test: pytest does not collect it. The figures in docs/server.md under "Scheduling" come from it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

# The repository before tests/, whose server/ folder would otherwise shadow the package.
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2]), str(Path(__file__).parents[1])]

import httpx  # noqa: E402

from server_support import model_server_process  # noqa: E402

NORMAL = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


def timed(base: str, body: dict) -> float:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batched-session", type=int, default=1)
    args = ap.parse_args()

    with model_server_process("--batched-session", str(args.batched_session), "--log-level", "warning",
                              root=args.repo.resolve()) as srv:
        idle = min(timed(srv.base, NORMAL) for _ in range(3))
        load = {"prompt": "Once upon a time, in a land far away,", "max_tokens": args.max_tokens,
                "temperature": 0, "n": args.n}
        load_s: list[float] = []
        bg = threading.Thread(target=lambda: load_s.append(timed(srv.base, load)), daemon=True)
        bg.start()
        while not httpx.get(srv.base + "/health", timeout=10).json()["busy"]:
            time.sleep(0.01)
        loaded = timed(srv.base, NORMAL)
        bg.join()
    print(f"repo {args.repo}, --batched-session {args.batched_session}: a 12-token completion "
          f"{idle:.2f} s idle, {loaded:.2f} s while an n={args.n} x {args.max_tokens}-token request ran "
          f"({load_s[0]:.1f} s in all): {loaded / idle:.2f}x")


if __name__ == "__main__":
    main()
