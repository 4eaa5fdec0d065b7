"""`ds4-bench product`: the engine's decode speed through every product path, side by side.

    ds4-bench product [-m GGUF] [--device cpu|cuda] [--rounds 3] [--decode-tokens 128] [--streams 8]
                      [--threads N] [--busy N] [--json FILE]

What users get is not the engine's speed in a tight loop but the engine inside ds4-eval or
behind ds4-server.  This benchmark measures, in one process and interleaved round by round
(each round rotates the order, so the slow phases of a shared machine fall on every path
alike), one greedy decode of the same chat prompt through:

  engine      the session API in a loop (sample, eval), as `ds4-bench engine` and the speed gate
  ds4-eval    the ds4-eval runner and engine backend on one fixed case of our own, serial
  server      one streaming /v1/chat/completions request to ds4-server (in-process uvicorn on
              127.0.0.1, configured as `ds4-server` configures it; the stream is read in this
              process by `ds4bench.rawstream`, a client light enough that its own CPU
              time takes little from the engine's)
  engine-xN   the engine's own batched decoding of N copies of the prompt (`engine.batch`'s
              scheduler; its slots hold all but the prompt's last token before the clock
              starts, as the server's copy of a shared prompt leaves them): what N rows give
              before any product loop touches them
  ds4-eval-xN N copies of the ds4-eval case run with `--parallel N` (aggregate); each case
              prefills its own prompt in a fresh session, as ds4-eval's batched cases do, so
              the span holds the later cases' prefill chunks (a ramp that longer
              `--decode-tokens` makes a smaller share of it)
  server-xN   N concurrent streams to a ds4-server with `--batched-session N` (aggregate)

All paths share one model and one `engine.threads.EngineThread`, as each product has one;
a server's loop owns that thread while the server is up, so the servers are started and
stopped inside each round.

Decode tokens/s of a path is (tokens - 1) / (time of the last token - time of the first),
so prefill and time to first token are left out (a server stream is timed by its content
pieces, from the tokens its first piece carried, so one whose first text was held back, as a
random-weight model's is, fails the run: `held_back`); the aggregate of N streams is all their
tokens after each stream's first over the span from the first stream's first token to the
last token (the engine's N rows and ds4-eval's N cases are timed the same way).  The summary
gives each path's median and its ratio to the engine: the median over rounds of the path's
rate over the engine's rate in the same round, with the lowest and highest of those ratios
(on a shared machine single rounds stray by tens of percent); a batched path is also stated
against the engine's N rows, as the ratio of those two medians;
`product_failures` lists the single-stream paths below a floor (the speed gate uses 0.9).
Where each token of a path came from one of the network's one-row decode steps (the CPU path;
not batched steps, nor CUDA's run-ahead), the table also splits its time per token into the
step's and the rest (`StepClock`): a path that lost speed around the step spends its time on
per-token work of its own, one that lost it inside the step had its cores taken or met a
slower moment of the host.  A line per single-stream path then gives its time outside the step
beyond the engine's loop as a share of the engine's time per token (`own_work_lines`): both
parts of a split come from one measurement, so this share does not move with the host's speed
the way a ratio of two measurements does.
Each single-stream path also has a whole-request time (`wall`): the engine's from a fresh
session to its last token, ds4-eval's from the case starting to the case finished (rendering,
tokenizing, prefill, decoding, extraction and grading), the server's from sending the request to
its last event.  The same tokens and prefill sit in all three, so a path's wall time minus the
engine's in the same round (`over_ms`, median over rounds) is what that path adds per request
or case: on CUDA, where a step is short, this is where a product loses the GPU.
`--device cuda` loads the model on the GPU (every path shares it, as on the CPU).
`--busy N` measures beside N child processes that each spin on a core (a competing load, for
the engine thread's thread-count choice).  Only same-run ratios mean anything on a shared
machine; absolute figures are context.
It does not compare commits (quality_testing.gate_speed does) nor measure prefill.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import click

from ds4bench.errors import RunFailure, UsageFailure
from ds4bench.inputs import model_file
from ds4bench.rawstream import RawStreamError, StampedStream, post_streams
from ds4eval.atomicfile import write_text_atomic

ENGINE, EVAL, SERVER = "engine", "ds4-eval", "server"
SINGLE_STREAM_PATHS = (EVAL, SERVER)
PROMPT = "Write a long story about a lighthouse keeper and his dog, with many chapters."


class ProductBenchError(ValueError):
    """A setting that cannot be measured; the message says which."""


@dataclass(frozen=True)
class ProductBenchConfig:
    """One `ds4-bench product` run; each field is one command-line flag."""

    model: str | None = None  # -m/--model: GGUF (default: the embedded model)
    device: str = "cpu"  # --device: where the model runs, "cpu" or "cuda"
    rounds: int = 3  # --rounds: interleaved repetitions of every path
    decode_tokens: int = 128  # --decode-tokens: tokens generated per measurement
    streams: int = 8  # --streams: N of the batched server path; 0 leaves it out
    threads: int | None = None  # --threads: the engine thread's torch threads (default: torch's)
    kv_type: str | None = None  # --kv-type: KV cache element type (default: the engine's)
    busy: int = 0  # --busy: other processes that each keep a core busy while measuring
    json_path: str | None = None  # --json: write the samples and the summary here

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ProductBenchError(f"--device must be cpu or cuda, not {self.device!r}")
        if self.rounds < 1:
            raise ProductBenchError("--rounds must be >= 1")
        if self.decode_tokens < 8:
            raise ProductBenchError("--decode-tokens must be >= 8")
        if self.streams < 0 or self.streams == 1:
            raise ProductBenchError("--streams must be 0 (off) or >= 2")
        if self.threads is not None and self.threads < 1:
            raise ProductBenchError("--threads must be >= 1")
        if self.busy < 0:
            raise ProductBenchError("--busy must be >= 0")

    @property
    def paths(self) -> tuple[str, ...]:
        rows = tuple(f"{p}-x{self.streams}" for p in (ENGINE, EVAL, SERVER)) if self.streams else ()
        return (ENGINE, EVAL, SERVER) + rows


# ---------------------------------------------------------------- pure parts

@dataclass(frozen=True)
class Sample:
    path: str
    round: int
    tokens: int  # tokens after the first one, over which the rate is taken
    seconds: float
    steps: int = 0  # the network's one-row decode steps in the whole measurement (StepClock)
    step_seconds: float = 0.0  # their time on the engine thread
    wall: float | None = None  # the whole request's seconds, single-stream paths only

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_ms(self) -> float | None:
        """Mean time of one decode step, or None where the tokens did not each come from one
        (batched steps, or CUDA's run-ahead, whose steps return before their work is done)."""
        if self.steps < self.tokens or self.steps == 0:
            return None
        return self.step_seconds / self.steps * 1e3

    @property
    def outside_ms(self) -> float | None:
        """Time per token outside the decode step: the path's own per-token work (and waits)."""
        step = self.step_ms
        if step is None or self.tokens < 1:
            return None
        return self.seconds / self.tokens * 1e3 - step


def decode_rate(stamps: Sequence[float], tokens: int | None = None) -> tuple[int, float]:
    """(tokens after the first, seconds from the first to the last) of one stream.

    `stamps` are the arrival times of output pieces; `tokens` is the stream's token count
    when a piece may carry several tokens (a server's usage), else one token per stamp."""
    n = len(stamps) if tokens is None else tokens
    if len(stamps) < 2 or n < 2:
        return 0, 0.0
    return n - 1, stamps[-1] - stamps[0]


# The most tokens a stream's first content piece may carry for its rate to start from it.
MAX_FIRST_PIECE_TOKENS = 2


def held_back(first_piece_tokens: int, tokens: int) -> str | None:
    """Why a server stream's rate cannot be measured, or None.

    A stream's rate counts its tokens (the usage's) from its first content piece to its last.
    ds4-server sends a stream's first text at once and merges the text of tokens that follow
    within its stream interval into the next piece, so later pieces may carry many tokens
    while the first carries one.  When the first carries more (`first_piece_tokens`: its text
    encoded again), its text was held back (tokens that are not whole characters, as a
    random-weight model writes, wait for the bytes that complete them; text that may start a
    stop or a tag waits for what follows), so it came well after the stream's first token and
    the rate would count time that is not in it: too fast, by any amount."""
    if first_piece_tokens <= MAX_FIRST_PIECE_TOKENS:
        return None
    return (f"the first of its pieces carried {first_piece_tokens} of its {tokens} tokens: the text was held "
            "back (tokens that are not whole characters, as a random-weight model's), so the first piece is "
            "not the first token and no decode rate can be measured")


def aggregate_rate(streams: Sequence[tuple[Sequence[float], int]]) -> tuple[int, float]:
    """All streams' tokens after their own first, over first-first-token to last token.

    (0, 0.0) when a stream has fewer than two timed pieces: its rate cannot be told apart from
    its time to first token."""
    if not streams or any(len(s) < 2 or n < 2 for s, n in streams):
        return 0, 0.0
    start = min(s[0] for s, _ in streams)
    end = max(s[-1] for s, _ in streams)
    return sum(n - 1 for _, n in streams), end - start


@dataclass(frozen=True)
class PathSummary:
    path: str
    median_tps: float
    low_tps: float
    high_tps: float
    ratio: float | None  # median over rounds of tps / the engine's tps in that round; None for the engine
    ratio_low: float | None = None  # the lowest and highest of those same-round ratios: how far
    ratio_high: float | None = None  # single rounds strayed, so a reader can tell noise from a change
    step_ms: float | None = None  # medians over rounds of Sample.step_ms and Sample.outside_ms:
    outside_ms: float | None = None  # whether a slower path lost its time in the step or around it
    wall_ms: float | None = None  # median over rounds of Sample.wall
    over_ms: float | None = None  # median over rounds of (wall - the engine's wall in that round)


def _median_of(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(samples: Sequence[Sample], paths: Sequence[str]) -> list[PathSummary]:
    by_path = {p: [s.tps for s in samples if s.path == p] for p in paths}
    # Paths run interleaved within a round, so each round's ratio to that round's engine sample
    # cancels the host's drift between rounds; the ratio is the median of those.
    engine_in = {s.round: s.tps for s in samples if s.path == ENGINE and s.tps > 0}
    engine_wall = {s.round: s.wall for s in samples if s.path == ENGINE and s.wall is not None}
    out = []
    for p in paths:
        v = by_path.get(p) or [0.0]
        mine = [s for s in samples if s.path == p]
        walls = [s.wall for s in mine if s.wall is not None]
        over = [(s.wall - engine_wall[s.round]) * 1e3 for s in mine
                if p != ENGINE and s.wall is not None and s.round in engine_wall]
        split = {"step_ms": _median_of([s.step_ms for s in mine]),
                 "outside_ms": _median_of([s.outside_ms for s in mine]),
                 "wall_ms": statistics.median(walls) * 1e3 if walls else None,
                 "over_ms": _median_of(over)}
        per_round = [s.tps / engine_in[s.round] for s in mine if s.round in engine_in]
        if p == ENGINE or not per_round:
            out.append(PathSummary(p, statistics.median(v), min(v), max(v), None, **split))
        else:
            out.append(PathSummary(p, statistics.median(v), min(v), max(v), statistics.median(per_round),
                                   min(per_round), max(per_round), **split))
    return out


def product_failures(summary: Sequence[PathSummary], floor: float) -> list[str]:
    """One line for each single-stream product path whose ratio to the engine is below floor."""
    return [f"{s.path} decodes at {s.ratio:.3f}x the engine (floor {floor:.2f}x)"
            for s in summary if s.path in SINGLE_STREAM_PATHS and s.ratio is not None and s.ratio < floor]


def render_table(summary: Sequence[PathSummary], rounds: int) -> str:
    from tabulate import tabulate

    def ratio(s: PathSummary) -> str:
        if s.ratio is None:
            return "1.000"
        spread = "" if s.ratio_low is None or s.ratio_high is None else f" [{s.ratio_low:.2f}, {s.ratio_high:.2f}]"
        return f"{s.ratio:.3f}{spread}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = [[s.path, f"{s.median_tps:.1f}", f"[{s.low_tps:.1f}, {s.high_tps:.1f}]", ratio(s), ms(s.step_ms),
             ms(s.outside_ms), ms(s.wall_ms), ms(s.over_ms)] for s in summary]
    single = next((s for s in summary if s.path == SERVER), None)
    lines = [tabulate(rows, headers=["path", "decode tok/s (median)", f"[min, max] of {rounds}",
                                     "x engine [min, max of rounds]", "step ms", "outside ms/token",
                                     "request ms", "+ms vs engine"],
                      disable_numparse=True)]
    by_path = {s.path: s for s in summary}
    for s in summary:
        product, batched, n = s.path.rpartition("-x")  # ("ds4-eval", "-x", "8"); ("", "", "server")
        if not batched or product == ENGINE:
            continue
        parts = []
        if product == SERVER and single is not None and single.median_tps > 0:
            parts.append(f"{s.median_tps / single.median_tps:.2f}x the server's single stream")
        rows = by_path.get(f"{ENGINE}-x{n}")
        if rows is not None and rows.ratio and s.ratio is not None:
            parts.append(f"{s.ratio / rows.ratio:.3f}x the engine's own {n} rows "
                         "(their same-round ratios to the engine)")
        if parts:
            lines.append(f"{s.path}: {', '.join(parts)}")
    lines += own_work_lines(summary)
    return "\n".join(lines)


def _engine_split(summary: Sequence[PathSummary]) -> tuple[float, float] | None:
    """The engine's (time per token, time outside the step per token), where its split is known."""
    engine = next((s for s in summary if s.path == ENGINE), None)
    if engine is None or engine.step_ms is None or engine.outside_ms is None:
        return None
    return engine.step_ms + engine.outside_ms, engine.outside_ms


def own_work_shares(summary: Sequence[PathSummary]) -> dict[str, float]:
    """Each single-stream path's time per token outside the step beyond the engine's loop, as a
    fraction of the engine's time per token; paths without a split (or with no engine split)
    are left out.

    Both parts of a split come from the same measurement, so a host that is faster or slower
    from one measurement to the next moves them together; this share is therefore far steadier
    than the rate ratio, and it is what the path itself costs (work inside the step that other
    threads take from it shows in the step column instead)."""
    engine = _engine_split(summary)
    if engine is None:
        return {}
    per_token, outside = engine
    return {s.path: (s.outside_ms - outside) / per_token
            for s in summary if s.path in SINGLE_STREAM_PATHS and s.outside_ms is not None}


def own_work_lines(summary: Sequence[PathSummary]) -> list[str]:
    """`own_work_shares` in words, a line per path, with the milliseconds behind each share."""
    engine = _engine_split(summary)
    if engine is None:
        return []
    per_token = engine[0]
    return [f"{path}: {share * per_token:+.3f} ms per token outside the step against the engine's loop "
            f"({share:+.1%} of its {per_token:.2f} ms per token)" for path, share in own_work_shares(summary).items()]


def own_work_failures(summary: Sequence[PathSummary], limit: float) -> list[str]:
    """One line for each single-stream path whose own per-token work exceeds `limit` of a token."""
    return [f"{path} spends {share:.1%} of a token on its own work outside the step (limit {limit:.1%})"
            for path, share in own_work_shares(summary).items() if share > limit]


# ---------------------------------------------------------------- the paths

@dataclass
class _Stamps:
    """Arrival times of a case's generated tokens, from the runner's Progress events."""

    times: list[float] = field(default_factory=list)
    last: int = 0
    started: float | None = None  # the case set running
    finished: float | None = None  # the case graded

    def on_event(self, event: object) -> None:
        from ds4eval.run.runner import CaseFinished, Progress, Status, StatusChanged

        if isinstance(event, Progress) and event.gen_tokens > self.last:
            self.last = event.gen_tokens
            self.times.append(time.perf_counter())
        elif isinstance(event, StatusChanged) and event.status is Status.PREFILL and self.started is None:
            self.started = time.perf_counter()
        elif isinstance(event, CaseFinished):
            self.finished = time.perf_counter()

    @property
    def wall(self) -> float | None:
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started


@dataclass
class _CaseStamps:
    """By case index (`--parallel` runs): when its generated tokens reached its worker, and how
    many it had then (the engine thread hands them over in batches: the first token alone,
    the last with the request's end, so the first-to-last span is that of the tokens)."""

    times: dict[int, list[float]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def on_event(self, event: object) -> None:
        from ds4eval.run.runner import Progress

        if isinstance(event, Progress) and event.gen_tokens > self.counts.get(event.index, 0):
            self.counts[event.index] = event.gen_tokens
            self.times.setdefault(event.index, []).append(time.perf_counter())


class StepClock:
    """Counts and times a network's one-row decode steps (`decode_frontier`) while held.

    A path slower than the engine either spends longer per token outside the step (its own
    per-token work: text, stops, events, streaming) or runs the step itself slower (other
    threads taking the engine's cores, a host getting slower); the two call for different
    fixes, and the rate alone cannot tell them apart.  Entering wraps the network's bound
    method for that object only (two clock reads per step, the same on every path); leaving
    restores it.  The steps run on the engine thread, and the counts are read after the path
    has finished with it."""

    def __init__(self, net: Any) -> None:
        self.net = net
        self.steps = 0
        self.seconds = 0.0

    def __enter__(self) -> "StepClock":
        step = self.net.decode_frontier
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return step(*args, **kwargs)
            finally:
                self.seconds += clock() - t
                self.steps += 1

        self.net.decode_frontier = timed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.net.decode_frontier  # the instance attribute; the class's method shows again


class _Paths:
    """The model, its engine thread and one measurement function per path."""

    def __init__(self, cfg: ProductBenchConfig, model: Any, engine_thread: Any) -> None:
        self.cfg, self.model, self.thread = cfg, model, engine_thread
        self.prompt_ids = model.tokenize(model.render_chat([{"role": "user", "content": PROMPT}]), special=True)
        if getattr(model, "add_bos", False):
            self.prompt_ids = [model.bos_id] + self.prompt_ids

    def run(self, path: str) -> tuple[int, float, float | None]:
        """(tokens after the first, their seconds, the whole request's seconds or None)."""
        if path == ENGINE:
            return self.thread.call(self._engine)
        if path == EVAL:
            return self._eval()
        if path == SERVER:
            return self._server(1)
        if path.startswith(ENGINE):
            return self.thread.call(self._engine_rows)
        if path.startswith(EVAL):
            return self._eval_rows()
        return self._server(self.cfg.streams)

    def _engine(self) -> tuple[int, float, float]:
        from engine import SamplingParams

        start = time.perf_counter()
        session = self.model.new_session()
        session.sync(self.prompt_ids)
        greedy = SamplingParams(temperature=0)
        # decode_tokens tokens, as the other paths are asked for: a stamp as each is sampled.
        tok = session.sample(greedy)
        stamps = [time.perf_counter()]
        for _ in range(self.cfg.decode_tokens - 1):
            session.eval(tok)
            tok = session.sample(greedy)
            stamps.append(time.perf_counter())
        return (*decode_rate(stamps), stamps[-1] - start)

    def _engine_rows(self) -> tuple[int, float, None]:
        from engine import SamplingParams
        from engine.batch import BatchScheduler, GenRequest

        n, ids = self.cfg.streams, self.prompt_ids
        scheduler = BatchScheduler(self.model, n)
        first = scheduler.session(0)
        first.sync(ids[:-1])
        for i in range(1, n):
            scheduler.session(i).copy_prefix_from(first, len(ids) - 1)
        stamps: list[list[float]] = [[] for _ in range(n)]
        for i in range(n):
            scheduler.submit(GenRequest(ids=list(ids), params=SamplingParams(temperature=0), slot=i,
                                        max_tokens=self.cfg.decode_tokens,
                                        on_token=lambda _t, mine=stamps[i]: mine.append(time.perf_counter())))
        scheduler.run()
        return (*aggregate_rate([(times, len(times)) for times in stamps]), None)

    def _cases(self, n: int) -> list[Any]:
        from ds4eval.cases.case import Case

        return [Case(source="ds4-bench", id=f"lighthouse-story-{i}", domain="bench", title="a long story",
                     question=PROMPT, choices=(), answer="-", aliases=(), answer_kind="exact_text",
                     suites=(), max_tokens=self.cfg.decode_tokens) for i in range(n)]

    def _run_cases(self, n: int, parallel: int | None, listener: Any) -> None:
        from ds4eval.config import EvalConfig
        from ds4eval.run.backends.engine_backend import EngineBackend
        from ds4eval.run.runner import Runner

        cfg = EvalConfig(tokens=self.cfg.decode_tokens, temperature=0.0, think=False, plain=True,
                         parallel=parallel)
        backend = EngineBackend(self.model, parallel=parallel, engine_thread=self.thread)
        try:
            Runner(cfg, self._cases(n), backend, [listener]).run()
        finally:
            backend.close()

    def _eval(self) -> tuple[int, float, float | None]:
        stamps = _Stamps()
        self._run_cases(1, None, stamps)
        return (*decode_rate(stamps.times), stamps.wall)

    def _eval_rows(self) -> tuple[int, float, None]:
        n = self.cfg.streams
        stamps = _CaseStamps()
        self._run_cases(n, n, stamps)
        return (*aggregate_rate([(stamps.times[i], stamps.counts[i]) for i in stamps.times]), None)

    def _server(self, streams: int) -> tuple[int, float, float | None]:
        from server.app import create_app
        from server.config import ServerConfig

        app = create_app(self.model, ServerConfig(batched_session=streams if streams > 1 else 1),
                         engine_thread=self.thread)
        with _LiveServer(app) as base:
            return _streams(base, streams, self.cfg.decode_tokens,
                            lambda text: len(self.model.tokenize(text, special=False)))


class _LiveServer:
    """uvicorn on a free 127.0.0.1 port in a thread, set up as `ds4-server` sets it up (its
    event loop and HTTP edge, `server.edge.uvicorn_config`), stopped (and its worker with it)
    on exit."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        from server.edge import EdgeLimits, uvicorn_config

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, EdgeLimits(), log_level="warning",
                                                    host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.server.run, name="ds4-bench-uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process ds4-server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(120)


_CONTENT, _EMPTY_CONTENT, _USAGE = '"content":', '"content":""', '"usage":{'


def _streams(base: str, n: int, tokens: int, count_tokens: Callable[[str], int]
             ) -> tuple[int, float, float | None]:
    """Decode rate of `n` concurrent chat streams read by the light client (`rawstream`), and
    for one stream the seconds from sending its request to its last content piece.  Each
    stream's tokens are counted from those of its first piece (`count_tokens` of its text)."""
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    host, port = base.removeprefix("http://").rsplit(":", 1)
    sent = time.perf_counter()
    try:
        streams = post_streams(host, int(port), "/v1/chat/completions", [body] * max(1, n))
    except RawStreamError as e:
        raise RuntimeError(f"ds4-server's stream: {e}") from None
    results = [timed_stream(s, count_tokens) for s in streams]
    if n <= 1:
        stamps = results[0][0]
        return (*decode_rate(*results[0]), stamps[-1] - sent if stamps else None)
    return (*aggregate_rate(results), None)


def timed_stream(stream: StampedStream, count_tokens: Callable[[str], int]) -> tuple[list[float], int]:
    """A chat stream's content-piece stamps and the tokens `decode_rate` counts over them: its
    completion tokens (from its usage chunk) less those of its first piece beyond one, which
    were decoded before that piece came (`count_tokens` of the piece's text).  Raises
    RuntimeError where its first text was held back (`held_back`).

    Chunks are told apart by their text, and only the first content chunk and the usage chunk
    are parsed, so that the client's own work per token stays small."""
    stamps: list[float] = []
    used = 0
    first_text = ""
    for data, t in zip(stream.events, stream.stamps):
        if _CONTENT in data and _EMPTY_CONTENT not in data:
            if not stamps:
                choices = json.loads(data).get("choices") or [{}]
                first_text = (choices[0].get("delta") or {}).get("content") or ""
            stamps.append(t)
        elif _USAGE in data:
            usage = json.loads(data).get("usage") or {}
            used = int(usage.get("completion_tokens") or 0)
    used = used or len(stamps)
    if len(stamps) < 2:  # decode_rate's to refuse
        return stamps, used
    first = count_tokens(first_text)
    if (why := held_back(first, used)) is not None:
        raise RuntimeError(f"ds4-server's stream: {why}")
    return stamps, used - max(0, first - 1)


class BusyProcesses:
    """`n` child processes spinning in a loop (a competing CPU load), killed on exit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[Any] = []

    def __enter__(self) -> "BusyProcesses":
        import subprocess
        import sys

        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def run_product_bench(cfg: ProductBenchConfig, model: Any, engine_thread: Any,
                      report: Callable[[str], None] = lambda _l: None) -> list[Sample]:
    """Every path `cfg.rounds` times, rotating the order each round."""
    paths = _Paths(cfg, model, engine_thread)
    order = list(cfg.paths)
    for p in order:  # untimed warm-up of every path: first calls allocate and compile
        paths.run(p)
    samples = []
    for r in range(cfg.rounds):
        k = r % len(order)
        for p in order[k:] + order[:k]:
            with StepClock(model.net) as steps:
                n, sec, wall = paths.run(p)
            if n < 1 or sec <= 0:
                raise RuntimeError(f"the {p} path gave fewer than two timed output pieces: nothing to measure "
                                   "(a case skipped for its context, or output held back until the end)")
            s = Sample(p, r, n, sec, steps.steps, steps.seconds, wall)
            samples.append(s)
            split = "" if s.step_ms is None else f"; step {s.step_ms:.3f} ms, outside {s.outside_ms:.3f} ms/token"
            split += "" if wall is None else f"; request {wall * 1e3:.1f} ms"
            report(f"[{r}] {p:<10} {s.tps:8.1f} tok/s ({n} tokens in {sec:.2f} s{split})")
    return samples


# ---------------------------------------------------------------- command

@click.command("product")
@click.option("-m", "--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the model runs (every path shares it).")
@click.option("--rounds", type=int, default=3, show_default=True, help="Interleaved repetitions of every path.")
@click.option("--decode-tokens", type=int, default=128, show_default=True, help="Tokens per measurement.")
@click.option("--streams", type=int, default=8, show_default=True,
              help="Streams of the batched-server path (ds4-server --batched-session N); 0 leaves it out.")
@click.option("--threads", type=int, default=None, help="torch threads of the engine thread (default: torch's).")
@click.option("--kv-type", type=click.Choice(["f32", "f16", "bf16"]), default=None,
              help="KV cache element type (default: the engine's).")
@click.option("--busy", type=int, default=0, show_default=True,
              help="Measure beside this many other processes that each keep a core busy.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every sample and the summary as JSON.")
def product_command(model: str | None, device: str, rounds: int, decode_tokens: int, streams: int, threads: int | None,
                    kv_type: str | None, busy: int, json_path: str | None) -> int:
    """Decode tokens/s of the engine, ds4-eval and ds4-server in one process, as ratios to the engine."""
    from engine import ModelLoadError, load_model
    from engine.threads import EngineThread

    cfg = ProductBenchConfig(model=model, device=device, rounds=rounds, decode_tokens=decode_tokens, streams=streams,
                             threads=threads, kv_type=kv_type, busy=busy, json_path=json_path)
    try:
        cfg.validate()
    except ProductBenchError as e:
        raise UsageFailure(str(e)) from None
    path = model_file(cfg.model)
    with EngineThread("ds4-engine", threads=cfg.threads) as thread:
        try:
            loaded = thread.call(load_model, path, device=cfg.device, kv_type=cfg.kv_type)
        except ModelLoadError as e:
            raise UsageFailure(str(e)) from None
        click.echo(f"{os.path.basename(path)} on {cfg.device}: paths {', '.join(cfg.paths)}; {cfg.rounds} rounds of "
                   f"{cfg.decode_tokens} tokens; {cfg.busy} busy processes beside; threads "
                   f"{cfg.threads or 'auto'}; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
                   err=True)
        try:
            with BusyProcesses(cfg.busy):
                samples = run_product_bench(cfg, loaded, thread, report=lambda line: click.echo(line, err=True))
        except (RuntimeError, OSError, ValueError) as e:
            raise RunFailure(f"{type(e).__name__}: {e}") from None
    summary = summarize(samples, cfg.paths)
    click.echo(render_table(summary, cfg.rounds))
    if cfg.json_path:
        doc = {"config": asdict(cfg), "samples": [asdict(s) | {"tps": s.tps} for s in samples],
               "summary": [asdict(s) for s in summary]}
        try:
            write_text_atomic(cfg.json_path, json.dumps(doc, indent=1) + "\n")
        except OSError as e:
            raise RunFailure(f"cannot write {cfg.json_path}: {e.strerror or e}") from None
    return 0
