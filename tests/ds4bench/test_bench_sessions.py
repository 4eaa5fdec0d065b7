"""ds4-bench sessions on a tiny random GGUF: cells, memory skips, CSV, table, errors (no real weights)."""
from __future__ import annotations

import csv

import pytest
from click.testing import CliRunner

import engine
import engine.batch
from ds4bench import cli
from ds4bench import sessions as ss
from engine.synthetic import RandomModelSpec, write_random_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_gguf(tmp_path_factory.mktemp("sess") / "tiny.gguf", RandomModelSpec(seed=5, n_ctx=256))


def invoke(args):
    return CliRunner().invoke(cli.main, args)


def test_cells_fit_with_a_ten_percent_margin():
    need = lambda n, tokens: n * tokens * 100  # noqa: E731
    cells = ss.plan_cells(100, (8, 1, 4, 4), 10, need, available=48500)
    assert [c.n_sessions for c in cells] == [1, 4, 8]
    assert [c.need_bytes for c in cells] == [11000, 44000, 88000]  # contexts include the decode tokens
    assert [c.fits for c in cells] == [True, True, False]  # 4 needs 48400 with its margin
    tight = ss.plan_cells(100, (4,), 10, need, available=48300)
    assert not tight[0].fits  # 44000 alone would fit; the margin does not


def test_measure_batch_returns_sessions_to_their_context(tiny):
    model = engine.load_model(tiny)
    sessions = [model.new_session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.sync([5 + i] * 10)
    first = [int(s.logits.argmax()) for s in sessions]
    calls = []

    def decode(rows, tokens):
        calls.append(list(tokens))
        engine.batch.decode_batch(rows, tokens)

    seconds = ss.measure_batch(sessions, first, 10, 4, decode)
    assert seconds > 0 and len(calls) == 4 and calls[0] == first
    assert [s.n_past for s in sessions] == [10, 10, 10]
    # Greedy continuation of each row: the second step fed each session its own argmax.
    again = [model.new_session() for _ in range(3)]
    for i, s in enumerate(again):
        s.sync([5 + i] * 10)
        s.eval(first[i])
    assert calls[1] == [int(s.logits.argmax()) for s in again]


def test_run_writes_csv_and_table_with_ratios(tiny, tmp_path):
    out = tmp_path / "s.csv"
    r = invoke(["sessions", "--model", tiny, "--sessions", "1,2,8", "--contexts", "16,40", "--decode-tokens", "3",
                "--repeats", "2", "--threads", "1", "--kv-type", "f16", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    assert "aggregate vs N=1" in r.output and "ctx 16: aggregate N=8 / N=1" in r.output
    assert "KV cache float16, decode attention: compiled CPU kernel" in r.output
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 2 * 3 * 2
    assert {(x["ctx"], x["n_sessions"]) for x in rows} == {(c, n) for c in ("16", "40") for n in ("1", "2", "8")}
    for x in rows:
        assert x["status"] == "ok" and x["threads"] == "1" and x["n_ctx"] == "43"
        assert x["kv_dtype"] == "float16" and x["attention"].startswith("compiled CPU kernel (")
        agg, per = float(x["aggregate_tokens_per_s"]), float(x["per_session_tokens_per_s"])
        assert agg == pytest.approx(per * int(x["n_sessions"]), rel=1e-3)
        assert float(x["seconds"]) == pytest.approx(3 / per, rel=1e-3)


def test_cells_that_do_not_fit_are_skipped_and_said(tiny, tmp_path, monkeypatch):
    model = engine.load_model(tiny)
    per_session = engine.batch.capacity_need(model, 2, 20) - engine.batch.capacity_need(model, 1, 20)
    # Room for two sessions of 16 + 4 tokens (with the margin), not for four.
    avail = int(1.1 * engine.batch.capacity_need(model, 2, 20)) + per_session // 2
    monkeypatch.setattr(engine.batch, "available_bytes", lambda device: avail)
    out = tmp_path / "skip.csv"
    r = invoke(["sessions", "--model", tiny, "--sessions", "1,2,4", "--contexts", "16", "--decode-tokens", "4",
                "--repeats", "1", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    assert "skipped: needs" in r.output
    rows = list(csv.DictReader(open(out)))
    assert [(x["n_sessions"], x["status"]) for x in rows] == [("1", "ok"), ("2", "ok"), ("4", "skipped: memory")]
    assert rows[2]["repeat"] == "" and float(rows[2]["need_mib"]) > 0


@pytest.mark.parametrize("args,needle", [
    (["--sessions", "0,2"], "--sessions must be positive"),
    (["--contexts", "a"], "comma-separated"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--decode-tokens", "0"], "--decode-tokens must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
])
def test_bad_input_is_one_line(tiny, args, needle):
    r = invoke(["sessions", "--model", tiny, *args])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-bench: error: ") and needle in lines[0], r.output


def test_missing_model_is_one_line(tmp_path):
    r = invoke(["sessions", "--model", str(tmp_path / "none.gguf")])
    assert r.exit_code == 2 and "model file not found" in r.output
