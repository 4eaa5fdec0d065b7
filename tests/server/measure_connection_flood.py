"""`python tests/server/measure_connection_flood.py [N]`: what N idle connections (default 5,000)
do to a ds4-server with its default limits (the fake engine, in a subprocess).

One client opens N connections that never send a request, asking `/health` on a kept-alive
connection every 500 connections; then it counts how each connection was answered (503, closed
without an answer, still served), the server's open file descriptors, and how long a new
connection waits for `/health` to answer 200 again. A measurement, not a test: pytest does not
collect it. The figures in docs/server.md under "Security" come from it.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import httpx  # noqa: E402

from server_support import server_process  # noqa: E402


def outcome(s: socket.socket) -> str:
    s.setblocking(False)
    try:
        data = s.recv(4096)
    except BlockingIOError:
        return "served (idle)"
    except ConnectionResetError:
        return "reset"
    if data.startswith(b"HTTP/1.1 503"):
        return "503"
    return "closed without an answer" if data == b"" else "other"


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, server_process(Path(tmp) / "server.log") as srv:
        kept = httpx.Client(base_url=srv.base, timeout=10)
        kept.get("/health")
        socks: list[socket.socket] = []
        during: list[float] = []
        t0 = time.monotonic()
        for i in range(n):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
            if i % 500 == 0:
                t = time.monotonic()
                kept.get("/health")
                during.append(time.monotonic() - t)
        opened = time.monotonic() - t0
        time.sleep(0.5)
        fds = len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
        t = time.monotonic()
        after = kept.get("/health").status_code, time.monotonic() - t
        counts: dict[str, int] = {}
        for s in socks:
            kind = outcome(s)
            counts[kind] = counts.get(kind, 0) + 1
        t = time.monotonic()
        new = httpx.get(srv.base + "/health", timeout=5).status_code
        while httpx.get(srv.base + "/health", timeout=5).status_code != 200:
            time.sleep(0.1)
        recovered = time.monotonic() - t
        print(f"{n} idle connections opened in {opened:.1f} s; server file descriptors 0.5 s later: {fds}")
        print(f"/health on a kept-alive connection while opening: median {statistics.median(during) * 1000:.0f} ms, "
              f"worst {max(during) * 1000:.0f} ms; after: {after[0]} in {after[1] * 1000:.0f} ms")
        print("connections: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        print(f"/health on a new connection: {new} at first, 200 after {recovered:.1f} s")
        for s in socks:
            s.close()
        kept.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
