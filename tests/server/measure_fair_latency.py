"""`python tests/server/measure_fair_latency.py [--repo DIR] [--n 128] [--max-tokens 16] [--schemas 4]
[--schema-kind admitted|issue] [--long-prompts K] [--delay S] [--batched-session N] [--runs 3]`: issue 42's fairness target on the
embedded model: a normal request's latency while one request of `--n` choices, `--schemas`
worst-case JSON-schema requests and `--long-prompts` long-prompt completions run, as a ratio to
its idle latency (the target is 2x).

Each run starts `python -m server.cli` (the embedded model) from `--repo` (default: this
checkout; give another checkout to measure the code before a change), sends the normal request
three times alone (the best time is the idle latency), then fires the load from threads: the
many-choice request and the schema requests, each a chat completion constrained by the largest
schema the server still admits (`worst_case_schema`: one object of as many optional properties
as `server.constraints.MAX_SCHEMA_MEMBERS` admits, their names as long as `MAX_SCHEMA_BYTES`
allows; the grammar engine's cost grows with them; each schema's names differ, so that no
cache of compiled grammars can serve one from another) or, with `--schema-kind issue`, by the
hostile schemas the server refuses (`issue_schema`), and the long prompts (about
`--long-prompt-tokens` each, different from their first word, so that each is prefilled in
full). It waits until `/health` says the worker is busy and every load request has left the
client, `--delay` seconds more (0: the normal request arrives with the load; more: into a load
already running), then times the normal request again, and stops the server without waiting
for the load. `--server-log PREFIX` keeps each run's server log (level info), `--py-spy EXE`
profiles the server from just before the load until the normal request is answered (raw
collapsed stacks of every thread, idle ones included, in `--py-spy-out`.K.txt).
Both timed requests are greedy `/v1/completions` with different prompts. It prints each run's
figures, then the ratios' spread.

The client shares the server's cores, and what it spends there is not the server's doing: so
the load's bodies are encoded before the clock starts, and the threads that send them run at
`--load-nice` (Linux nice values are per thread), so that the server's thread governor, which
leaves niced work out (`engine.threads`), does not give a core up to them; 0 measures with the
client competing as before. A measurement, not a test: pytest does not collect it. The
figures in docs/server.md under "Scheduling" come from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

# The repository before tests/, whose server/ folder would otherwise shadow the package.
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2]), str(Path(__file__).parents[1])]

import httpx  # noqa: E402

from server_support import model_server_process  # noqa: E402

NORMAL = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
SCHEMA_LIMIT_BYTES = 64 * 1024
SCHEMA_LIMIT_MEMBERS = 256
"""`server.constraints.MAX_SCHEMA_BYTES` and `MAX_SCHEMA_MEMBERS` (not imported: `--repo` may be
another checkout)."""


def worst_case_schema(variant: int = 0, limit: int = SCHEMA_LIMIT_BYTES,
                      members: int = SCHEMA_LIMIT_MEMBERS) -> dict:
    """One object of `members` optional string properties whose names are as long as `limit`
    bytes of compact JSON allow (the most properties in one object, the largest lexemes).
    Schemas of different `variant`s differ in every name (no grammar cache can share them)."""
    def schema(width: int) -> dict:
        return {"type": "object",
                "properties": {f"v{variant}p{i:0{width}d}": {"type": "string"} for i in range(members)}}

    def size(width: int) -> int:
        return len(json.dumps(schema(width), separators=(",", ":")).encode())

    width = 5
    while size(width + 1) <= limit:
        width += 1
    return schema(width)


def issue_schema(variant: int) -> dict:
    """The worst cases of the schemas that hostile clients sent, alternately: a required recursive
    `$ref` (variant even) and an object of 10,000 optional properties, about 0.3 MB (odd). The
    server refuses both before queuing (a cycle of required references; over its size limit)."""
    if variant % 2 == 0:
        return {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                     "required": ["c"]}}}
    return {"type": "object", "properties": {f"v{variant}f{i:05d}": {"type": "string"} for i in range(10_000)}}


SCHEMAS = {"admitted": worst_case_schema, "issue": issue_schema}


def timed(base: str, path: str, body: dict | bytes) -> tuple[float, int]:
    """Seconds and status of one POST; `body` a JSON value or its encoded bytes."""
    encoded = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.monotonic()
    r = httpx.post(base + path, content=encoded, headers={"content-type": "application/json"}, timeout=3600)
    return time.monotonic() - t0, r.status_code


def long_prompt(variant: int, words: int) -> str:
    """A prompt of about `words` tokens, different from the first word on for each `variant`
    (no prefix cache can serve one from another)."""
    return f"Variant {variant}. " + " ".join(f"w{variant}x{i % 97}" for i in range(words // 4))


def load_requests(args: argparse.Namespace) -> list[tuple[str, dict]]:
    loads: list[tuple[str, dict]] = []
    if args.n:
        loads.append(("/v1/completions", {"prompt": "Once upon a time, in a land far away,",
                                          "max_tokens": args.max_tokens, "temperature": 0, "n": args.n}))
    loads += [("/v1/chat/completions",
               {"messages": [{"role": "user", "content": f"Fill in record {i} as JSON."}],
                "max_tokens": args.max_tokens, "temperature": 0,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": f"r{i}", "schema": SCHEMAS[args.schema_kind](i)}}})
              for i in range(args.schemas)]
    loads += [("/v1/completions", {"prompt": long_prompt(i, args.long_prompt_tokens),
                                   "max_tokens": args.max_tokens, "temperature": 0})
              for i in range(args.long_prompts)]
    return loads


def describe_load(args: argparse.Namespace) -> str:
    parts = [f"an n={args.n} x {args.max_tokens}-token request"] if args.n else []
    if args.schemas:
        kind = "worst-case admitted" if args.schema_kind == "admitted" else "refused hostile"
        parts.append(f"{args.schemas} {kind} schema requests")
    if args.long_prompts:
        parts.append(f"{args.long_prompts} prompts of about {args.long_prompt_tokens} tokens")
    return " and ".join(parts) or "nothing"


def one_run(args: argparse.Namespace, k: int) -> tuple[float, float, list[int]]:
    """(idle seconds, loaded seconds, statuses of the load requests that ended meanwhile)."""
    import subprocess

    loads = [(path, json.dumps(body).encode()) for path, body in load_requests(args)]
    flags = ["--batched-session", str(args.batched_session), "--log-level", "info" if args.server_log else "warning"]
    with model_server_process(*flags, *args.server_flag, root=args.repo.resolve()) as srv:
        idle = min(timed(srv.base, "/v1/completions", NORMAL)[0] for _ in range(3))
        sent = threading.Semaphore(0)
        statuses: list[int] = []

        def fire(path: str, body: bytes) -> None:
            if args.load_nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.load_nice)
            sent.release()
            try:
                statuses.append(timed(srv.base, path, body)[1])
            except httpx.HTTPError:
                pass  # the server stopped under it: the run is over

        spy = None
        if args.py_spy:
            spy = subprocess.Popen([args.py_spy, "record", "--threads", "--idle", "-r", "200", "-f", "raw",
                                    "-o", f"{args.py_spy_out}.{k}.txt", "-p", str(srv.proc.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
        for path, body in loads:
            threading.Thread(target=fire, args=(path, body), daemon=True).start()
        for _ in loads:
            sent.acquire()
        # Refused requests never make the worker busy: wait for them to be answered instead.
        while (loads and len(statuses) < len(loads)
               and not httpx.get(srv.base + "/health", timeout=10).json()["busy"]):
            time.sleep(0.01)
        time.sleep(args.delay)
        loaded, status = timed(srv.base, "/v1/completions", NORMAL)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
        if args.server_log:
            Path(f"{args.server_log}.{k}.log").write_text("".join(srv.log))
        if status != 200:
            raise SystemExit(f"the normal request answered {status}")
    return idle, loaded, statuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--n", type=int, default=128, help="choices of the many-choice request (0: none)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--schemas", type=int, default=4, help="worst-case JSON-schema requests in the load, each distinct")
    ap.add_argument("--schema-kind", choices=sorted(SCHEMAS), default="admitted",
                    help="admitted: the largest schemas the server still compiles; issue: the hostile ones it refuses")
    ap.add_argument("--long-prompts", type=int, default=0, help="long-prompt completions in the load, each distinct")
    ap.add_argument("--long-prompt-tokens", type=int, default=1800, help="about how long each of them is")
    ap.add_argument("--delay", type=float, default=0.0,
                    help="seconds between the worker turning busy and the normal request")
    ap.add_argument("--batched-session", type=int, default=1)
    ap.add_argument("--load-nice", type=int, default=10,
                    help="nice value of the threads that send the load (0: as the rest of the client)")
    ap.add_argument("--server-flag", action="append", default=[], help="one more ds4-server argument (repeatable)")
    ap.add_argument("--runs", type=int, default=3, help="fresh servers, one measurement each")
    ap.add_argument("--server-log", default=None, help="write each run's server log (level info) to PREFIX.K.log")
    ap.add_argument("--py-spy", default=None, help="a py-spy executable: profile the server under load")
    ap.add_argument("--py-spy-out", default="fair-profile", help="py-spy's raw output: PREFIX.K.txt")
    args = ap.parse_args()

    ratios = []
    for k in range(args.runs):
        idle, loaded, statuses = one_run(args, k + 1)
        ratios.append(loaded / idle)
        print(f"run {k + 1}: a 12-token completion {idle:.2f} s idle, {loaded:.2f} s while {describe_load(args)} "
              f"ran: {loaded / idle:.2f}x (load answers so far: {sorted(statuses)})", flush=True)
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x"
    print(f"repo {args.repo}, --batched-session {args.batched_session}: {spread} over {args.runs} runs")


if __name__ == "__main__":
    main()
