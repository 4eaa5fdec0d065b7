"""`ds4-bench shards`' arithmetic: the critical path of a sharded run, the per-round ratios and
the outputs that differ (the runs themselves need a Ray cluster: docs/measurements.md)."""

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import shards as sb
from ds4eval.run.trace import TraceRecord


def rec(i, elapsed):
    return TraceRecord(index=i, source="s", id=f"c{i}", elapsed_s=elapsed)


def test_the_critical_path_is_the_longest_shard():
    assert sb.critical_path_s([[rec(1, 1.0), rec(2, 2.0)], [rec(3, 2.5)]]) == 3.0
    assert sb.critical_path_s([]) == 0.0


def sample(path, round_, wall, outputs, critical=4.0, cases=4):
    return sb.Sample(path, round_, wall, cases, critical, outputs)


def test_summary_pairs_the_paths_round_by_round():
    same = {"s/a": "x", "s/b": "y"}
    samples = [sample(sb.ONE, 0, 10.0, same), sample(sb.RAY, 0, 8.0, same),
               sample(sb.RAY, 1, 12.0, {**same, "s/b": "z"}), sample(sb.ONE, 1, 10.0, same),
               sample(sb.ONE, 2, 20.0, same), sample(sb.RAY, 2, 11.0, same)]
    summary = sb.summarize(samples)
    assert summary["ratio"] == {"median": 0.8, "min": 0.55, "max": 1.2}
    assert summary["wall_s"] == {sb.ONE: 10.0, sb.RAY: 11.0}
    assert summary["overhead_per_case_s"][sb.ONE] == pytest.approx(1.5)
    assert summary["outputs_differ"] == ["s/b"]
    text = sb.render(summary, 3)
    assert "ray / one process wall time: 0.80x (median of 3 rounds; 0.55-1.20)" in text
    assert "greedy outputs that differ: 1" in text


def test_bad_settings_are_one_line():
    r = CliRunner().invoke(cli.main, ["shards", "--ray", "127.0.0.1:1", "--rounds", "0"])
    assert r.exit_code == 2 and "--rounds must be at least 1" in r.output
