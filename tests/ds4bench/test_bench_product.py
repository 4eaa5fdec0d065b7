"""ds4-bench product: rates, summary, floor and held-back streams (pure), and whole runs on tiny
random GGUFs."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import product as pb
from ds4bench.rawstream import StampedStream
from engine.synthetic import PRESETS, RandomModelSpec, write_moe_gguf, write_random_gguf


def test_decode_rate_leaves_out_the_first_token():
    assert pb.decode_rate([10.0, 10.5, 11.0, 11.5]) == (3, 1.5)
    # A server's piece may carry several tokens: the usage count wins over the stamp count.
    assert pb.decode_rate([1.0, 3.0], tokens=9) == (8, 2.0)
    assert pb.decode_rate([1.0]) == (0, 0.0)
    assert pb.decode_rate([]) == (0, 0.0)


def test_aggregate_rate_spans_first_first_token_to_last_token():
    streams = [([0.0, 1.0, 2.0], 3), ([0.5, 1.5, 2.5], 3)]
    assert pb.aggregate_rate(streams) == (4, 2.5)
    # One stream that came in one piece makes the aggregate unmeasurable, not larger.
    assert pb.aggregate_rate(streams + [([1.0], 5)]) == (0, 0.0)
    assert pb.aggregate_rate([]) == (0, 0.0)


def samples(**rates):
    out = []
    for path, values in rates.items():
        out += [pb.Sample(path.replace("_", "-"), r, int(v), 1.0) for r, v in enumerate(values)]
    return out


def test_summary_ratios_are_medians_of_same_round_ratios():
    s = samples(engine=[100, 110, 90], ds4_eval=[95, 96, 94], server=[80, 85, 90], server_x8=[300, 310, 320])
    summary = pb.summarize(s, ("engine", "ds4-eval", "server", "server-x8"))
    by = {x.path: x for x in summary}
    assert by["engine"].ratio is None and by["engine"].median_tps == 100
    assert by["ds4-eval"].ratio == pytest.approx(0.95)  # 0.95, 0.873, 1.044 by round
    assert (by["server"].low_tps, by["server"].median_tps, by["server"].high_tps) == (80, 85, 90)
    assert by["server"].ratio == pytest.approx(0.8)  # 0.8, 0.773, 1.0
    assert (by["server"].ratio_low, by["server"].ratio_high) == (pytest.approx(85 / 110), pytest.approx(1.0))
    assert by["engine"].ratio_low is None and by["engine"].ratio_high is None
    assert by["server-x8"].ratio == pytest.approx(3.0)
    # Only the single-stream product paths are held to the floor.
    assert pb.product_failures(summary, 0.9) == ["server decodes at 0.800x the engine (floor 0.90x)"]
    assert pb.product_failures(summary, 0.8) == []


def test_a_host_that_slows_between_rounds_does_not_move_the_ratio():
    # The host twice as fast after the first round: ds4-eval matches the engine in two rounds of
    # three, so the same-round ratios say 1.0x where a ratio of medians would say 0.9x (54/60).
    s = samples(engine=[30, 60, 60], ds4_eval=[30, 54, 60])
    by = {x.path: x for x in pb.summarize(s, ("engine", "ds4-eval"))}
    assert by["ds4-eval"].ratio == pytest.approx(1.0)
    s = samples(engine=[27, 48, 56], ds4_eval=[33, 45, 38])  # the kind of run that drifted
    assert pb.summarize(s, ("engine", "ds4-eval"))[1].ratio == pytest.approx(45 / 48)


def test_render_table_names_the_ratios():
    s = samples(engine=[100, 110, 90], ds4_eval=[95, 96, 94], server=[80, 85, 90], server_x8=[300, 310, 320])
    summary = pb.summarize(s, ("engine", "ds4-eval", "server", "server-x8"))
    table = pb.render_table(summary, 3)
    assert "ds4-eval" in table and "0.950 [0.87, 1.04]" in table  # the median and the rounds' spread
    assert "server-x8: 3.65x the server's single stream" in table


def test_the_batched_products_are_stated_against_the_engines_own_rows():
    s = samples(engine=[100, 100, 100], server=[95, 95, 95], server_x8=[300, 320, 310])
    s += [pb.Sample("engine-x8", r, 400, 1.0) for r in range(3)]
    s += [pb.Sample("ds4-eval-x8", r, 200, 1.0) for r in range(3)]
    summary = pb.summarize(s, ("engine", "server", "engine-x8", "ds4-eval-x8", "server-x8"))
    table = pb.render_table(summary, 3)
    assert "server-x8: 3.26x the server's single stream, 0.775x the engine's own 8 rows" in table
    assert "ds4-eval-x8: 0.500x the engine's own 8 rows" in table
    # Without the engine's rows (an older JSON, or a table of some paths), only the first half.
    table = pb.render_table([x for x in summary if x.path != "engine-x8"], 3)
    assert "server-x8: 3.26x the server's single stream\n" in table + "\n" and "own 8 rows" not in table


def test_a_sample_splits_its_time_per_token_into_the_step_and_the_rest():
    s = pb.Sample("server", 0, 100, 1.0, steps=102, step_seconds=0.918)
    assert s.step_ms == pytest.approx(9.0) and s.outside_ms == pytest.approx(1.0)
    # Fewer steps than tokens: the tokens came from batched steps (or ran ahead on CUDA), so
    # a step's time is not a token's and nothing is split.
    assert pb.Sample("server-x8", 0, 800, 1.0, steps=3, step_seconds=0.1).step_ms is None
    assert pb.Sample("server-x8", 0, 800, 1.0, steps=3, step_seconds=0.1).outside_ms is None
    assert pb.Sample("engine", 0, 10, 1.0).step_ms is None


def test_summary_and_table_carry_the_split():
    s = [pb.Sample("engine", r, 100, 1.0, 101, 0.909 + r * 0.101) for r in range(3)]
    s += [pb.Sample("server", r, 100, 1.0, 100, 0.8) for r in range(3)]
    s += [pb.Sample("server-x8", r, 800, 1.0, 2, 0.01) for r in range(3)]
    by = {x.path: x for x in pb.summarize(s, ("engine", "server", "server-x8"))}
    assert by["engine"].step_ms == pytest.approx(10.0)  # the middle round: 1.01 s / 101 steps
    assert by["engine"].outside_ms == pytest.approx(0.0, abs=1e-9)
    assert (by["server"].step_ms, by["server"].outside_ms) == (pytest.approx(8.0), pytest.approx(2.0))
    assert by["server-x8"].step_ms is None and by["server-x8"].outside_ms is None
    table = pb.render_table(list(by.values()), 3)
    assert "outside ms/token" in table and "8.000" in table and "2.000" in table
    row = next(line for line in table.splitlines() if line.startswith("server-x8"))
    assert row.split()[-2:] == ["-", "-"]
    # The server spends 2 ms per token around the step where the engine's loop spends none: a
    # fifth of the engine's 10 ms token, whatever the host did between the measurements.
    assert pb.own_work_lines(list(by.values())) == [
        "server: +2.000 ms per token outside the step against the engine's loop (+20.0% of its 10.00 ms per token)"]
    assert "server: +2.000 ms per token" in table
    # Without the engine's split there is nothing to set the others against.
    assert pb.own_work_lines([by["server"], by["server-x8"]]) == []
    assert pb.own_work_shares(list(by.values())) == {"server": pytest.approx(0.2)}
    assert pb.own_work_failures(list(by.values()), 0.25) == []
    assert pb.own_work_failures(list(by.values()), 0.1) == [
        "server spends 20.0% of a token on its own work outside the step (limit 10.0%)"]
    assert pb.own_work_failures([by["server"]], 0.1) == []  # nothing to judge without the engine's split


class _Net:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def decode_frontier(self, token: int, cache=None, eos_ids=frozenset(), cancel=None):
        if token < 0:
            raise ValueError("no such token")
        self.calls.append(token)
        return token * 2


def test_step_clock_counts_and_times_every_step_and_leaves_the_network_as_it_was():
    net = _Net()
    with pb.StepClock(net) as clock:
        assert [net.decode_frontier(t) for t in (1, 2, 3)] == [2, 4, 6]
        with pytest.raises(ValueError):
            net.decode_frontier(-1)  # a failed step is still a step that took time
    assert clock.steps == 4 and clock.seconds > 0 and net.calls == [1, 2, 3]
    assert "decode_frontier" not in vars(net)  # the class's own method again
    net.decode_frontier(5)
    assert clock.steps == 4


@pytest.mark.parametrize("args,message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--decode-tokens", "4"], "--decode-tokens must be >= 8"),
    (["--streams", "1"], "--streams must be 0 (off) or >= 2"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--busy", "-1"], "--busy must be >= 0"),
    (["-m", "/nonexistent/model.gguf"], "model file not found"),
])
def test_bad_settings_are_one_line_errors(args, message):
    r = CliRunner().invoke(cli.main, ["product", *args])
    assert r.exit_code == 2
    assert message in r.output and "Traceback" not in r.output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_gguf(tmp_path_factory.mktemp("product") / "tiny.gguf",
                             RandomModelSpec(seed=9, n_ctx=1024, n_layer=2))


def test_a_path_with_nothing_to_time_fails_the_run(tiny):
    # A random model's greedy chat reply is whitespace, which the server sends in one piece at
    # the end: its decode rate cannot be measured, and the run says so instead of reporting 0.
    r = CliRunner().invoke(cli.main, ["product", "-m", tiny, "--rounds", "1", "--decode-tokens", "8",
                                      "--streams", "0"])
    assert r.exit_code == 1
    assert "the server path gave fewer than two timed output pieces" in r.output


def test_a_stream_whose_first_piece_carries_many_tokens_cannot_be_timed():
    # the first piece one token (or a character of two): later pieces may merge many, as the
    # server's stream interval merges a fast model's tokens, and the rate still counts from it
    assert pb.held_back(1, 256) is None
    assert pb.held_back(2, 6) is None
    # 40 of 128 tokens were decoded before the first piece arrived
    why = pb.held_back(40, 128)
    assert why is not None and "the first of its pieces carried 40 of its 128 tokens" in why


def _chat_stream(pieces: list[tuple[float, str]], completion_tokens: int) -> StampedStream:
    """A stream as ds4-server writes it: the role chunk, one chunk a content piece, the usage."""
    def chunk(delta: dict, usage: dict | None = None) -> str:
        return json.dumps({"object": "chat.completion.chunk", "choices": [] if usage else
                           [{"index": 0, "delta": delta, "finish_reason": None}], "usage": usage},
                          separators=(",", ":"))
    events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": text}) for _, text in pieces]
    events.append(chunk({}, {"prompt_tokens": 9, "completion_tokens": completion_tokens}))
    stamps = [pieces[0][0]] + [t for t, _ in pieces] + [pieces[-1][0]]
    return StampedStream(tuple(events), tuple(stamps))


def words(text: str) -> int:
    return len(text.split())


def test_a_stream_is_timed_from_its_first_piece_whatever_the_later_pieces_merged():
    # a fast model's tokens merged by the server's stream interval: one word, then four a piece
    stream = _chat_stream([(1.0, "Once"), (1.025, " upon a time there"), (1.05, " was a lighthouse keeper")], 9)
    stamps, tokens = pb.timed_stream(stream, words)
    assert stamps == [1.0, 1.025, 1.05] and tokens == 9
    assert pb.decode_rate(stamps, tokens) == (8, pytest.approx(0.05))
    # a first piece of two tokens: the second was decoded before it came, out of the span
    stamps, tokens = pb.timed_stream(_chat_stream([(2.0, "Once upon"), (2.1, " a time")], 4), words)
    assert pb.decode_rate(stamps, tokens) == (2, pytest.approx(0.1))


def test_a_stream_whose_first_text_was_held_back_fails_instead_of_giving_a_rate():
    stream = _chat_stream([(3.0, "Once upon a time there was"), (3.01, " a keeper")], 8)
    with pytest.raises(RuntimeError, match="the first of its pieces carried 6 of its 8 tokens"):
        pb.timed_stream(stream, words)
    # one piece: nothing to time, which decode_rate refuses (the run then says so)
    stamps, tokens = pb.timed_stream(_chat_stream([(4.0, "Once upon a time")], 4), words)
    assert pb.decode_rate(stamps, tokens) == (0, 0.0)


def test_a_server_stream_of_merged_pieces_is_timed(tmp_path):
    # This random model decodes fast enough on CPU for the server to merge several of its tokens
    # into each piece after the first; the stream is timed all the same.
    path = str(tmp_path / "moe.gguf")
    write_moe_gguf(path, PRESETS["qwen3moe-tiny"])
    r = CliRunner().invoke(cli.main, ["product", "-m", path, "--rounds", "1", "--decode-tokens", "64",
                                      "--streams", "0"])
    assert r.exit_code == 0, r.output
    assert "[0] server" in r.output and "(63 tokens in" in r.output.split("[0] server")[1]


@pytest.mark.model
def test_a_whole_run_measures_every_path(embedded_path, tmp_path):
    out = tmp_path / "product.json"
    r = CliRunner().invoke(cli.main, ["product", "-m", embedded_path, "--rounds", "2", "--decode-tokens", "12",
                                      "--streams", "2", "--busy", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    paths = ["engine", "ds4-eval", "server", "engine-x2", "ds4-eval-x2", "server-x2"]
    assert [s["path"] for s in doc["summary"]] == paths
    assert sorted(s["path"] for s in doc["samples"]) == sorted(paths * 2)
    assert all(s["tokens"] >= 5 and s["tps"] > 0 for s in doc["samples"])
    assert doc["summary"][0]["ratio"] is None and all(s["ratio"] > 0 for s in doc["summary"][1:])
    # Single streams decode one step per token on the CPU, so their time splits; the batched
    # server's tokens come from batched steps, so its does not.
    by = {s["path"]: s for s in doc["summary"]}
    assert all(by[p]["step_ms"] > 0 and by[p]["outside_ms"] is not None for p in paths[:3])
    # The batched server's rows mostly share steps, so it usually has fewer one-row steps than
    # tokens and no split; when a stream runs ahead and sits out steps, its rows take steps alone.
    x2 = [s for s in doc["samples"] if s["path"] == "server-x2"]
    if all(s["steps"] < s["tokens"] for s in x2):
        assert by["server-x2"]["step_ms"] is None
    # Every single stream has a whole-request time; ds4-eval's and the server's are compared to
    # the engine's (what each adds around the same prefill and tokens), the batched one has none.
    assert all(by[p]["wall_ms"] > 0 for p in paths[:3]) and by["server-x2"]["wall_ms"] is None
    assert by["engine"]["over_ms"] is None and all(by[p]["over_ms"] is not None for p in paths[1:3])
    # The engine's own two rows: two streams of batched steps, no split and no request time.
    rows = [s for s in doc["samples"] if s["path"] == "engine-x2"]
    assert len(rows) == 2 and all(s["tokens"] == 2 * (12 - 1) for s in rows)
    assert by["engine-x2"]["step_ms"] is None and by["engine-x2"]["wall_ms"] is None
    assert "x engine" in r.output and "server-x2" in r.output
    assert "the engine's own 2 rows" in r.output
    # ds4-eval's two cases in parallel: both cases' tokens, handed to their workers in batches.
    cases = [s for s in doc["samples"] if s["path"] == "ds4-eval-x2"]
    assert len(cases) == 2 and all(s["tokens"] == 2 * (12 - 1) for s in cases)
    assert "ds4-eval-x2: " in r.output
    assert doc["config"]["busy"] == 1


def test_busy_processes_spin_while_held_and_are_gone_after():
    with pb.BusyProcesses(2) as busy:
        assert len(busy.procs) == 2 and all(p.poll() is None for p in busy.procs)
    assert all(p.poll() is not None for p in busy.procs)


def test_request_overhead_is_the_median_of_same_round_differences_to_the_engine():
    s = [pb.Sample("engine", r, 10, 1.0, wall=w) for r, w in enumerate([1.0, 2.0, 1.5])]
    s += [pb.Sample("ds4-eval", r, 10, 1.0, wall=w) for r, w in enumerate([1.03, 2.01, 1.6])]
    s += [pb.Sample("server-x4", r, 40, 1.0) for r in range(3)]
    by = {x.path: x for x in pb.summarize(s, ("engine", "ds4-eval", "server-x4"))}
    assert by["engine"].wall_ms == pytest.approx(1500) and by["engine"].over_ms is None
    assert by["ds4-eval"].over_ms == pytest.approx(30)  # 30, 10 and 100 ms by round
    assert by["server-x4"].wall_ms is None and by["server-x4"].over_ms is None
    assert "+ms vs engine" in pb.render_table(list(by.values()), 3)


def test_device_must_be_cpu_or_cuda():
    with pytest.raises(pb.ProductBenchError, match="--device must be cpu or cuda"):
        pb.ProductBenchConfig(device="tpu").validate()
