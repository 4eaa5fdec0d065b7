"""The parts of `ds4-eval run --ray` that need no cluster: task resources and shard counts, the
run's states rebuilt from its merged trace, and the check of a shard folder left by another run."""

import pytest

from ds4eval.cases.suites import load_suite
from ds4eval.config import EvalConfig
from ds4eval.run import raycluster as rc
from ds4eval.run import shards
from ds4eval.run import trace as tr
from ds4eval.run.runner import Status

SANITY = load_suite("sanity", None)


@pytest.mark.parametrize("cfg,resources,expected", [
    (EvalConfig(ray=""), {"CPU": 2.0}, rc.Slots(1, 0, 2)),
    (EvalConfig(ray="", threads=2), {"CPU": 5.0}, rc.Slots(2, 0, 2)),
    (EvalConfig(ray="", device="cuda"), {"CPU": 64.0, "GPU": 8.0}, rc.Slots(1, 1, 8)),
    (EvalConfig(ray="", ray_shards=16, device="cuda"), {"GPU": 8.0}, rc.Slots(1, 1, 16)),
    (EvalConfig(ray="", backend="openai", urls=("http://127.0.0.1:1",), concurrency=8), {"CPU": 3.0},
     rc.Slots(1, 0, 3)),
])
def test_task_resources_and_shard_count(cfg, resources, expected):
    assert rc.plan_slots(cfg, resources) == expected


def test_a_cluster_without_the_resources_is_refused():
    with pytest.raises(rc.RayUnavailable, match="no GPU"):
        rc.plan_slots(EvalConfig(ray="", device="cuda"), {"CPU": 8.0})
    with pytest.raises(rc.RayUnavailable, match="no 4 free CPU"):
        rc.plan_slots(EvalConfig(ray="", threads=4), {"CPU": 2.0})


def test_states_are_rebuilt_from_the_merged_trace():
    cases = {(c.source, c.id): c for c in SANITY[:3]}
    header = tr.RunHeader("sanity", tuple((n, c.source, c.id) for n, c in enumerate(SANITY[:3], 1)), 2)
    recs = [tr.TraceRecord(index=1, source="sanity", id=SANITY[0].id, status="PASSED", picked="A", gen_tokens=7,
                           elapsed_s=0.5, repeat=1, ttft_s=0.1, e2e_s=0.5, model_output="Answer: A"),
            tr.TraceRecord(index=2, source="sanity", id=SANITY[1].id, status="STOPPED", repeat=0)]
    states = rc.states_of(recs, cases, header)
    assert [(s.number, s.repeat) for s in states] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [s.status for s in states] == [Status.PENDING, Status.PASSED, Status.STOPPED] + [Status.PENDING] * 3
    assert states[1].gen_tokens == 7 and states[1].output == "Answer: A" and states[1].latency.ttft_s == 0.1


def test_a_shard_folder_of_another_run_is_refused(tmp_path):
    parts = [shards.part(SANITY, shards.Shard(i, 2), 1, "{}") for i in range(2)]
    rc.check_shard_dir(str(tmp_path / "absent"), parts)  # nothing there yet: fine
    other = shards.part(SANITY[:40], shards.Shard(0, 2), 1, "{}")
    header = tr.RunHeader("sanity", (), 1, **other.header_fields())
    path = rc.shard_path(str(tmp_path), parts[0].shard)
    with open(path, "w") as f:
        f.write(tr.format_run_header(header))
    with pytest.raises(rc.RayUnavailable, match="another selection's shard"):
        rc.check_shard_dir(str(tmp_path), parts)
    with open(path, "w") as f:
        f.write(tr.format_run_header(tr.RunHeader("sanity", (), 1, **parts[0].header_fields())))
    rc.check_shard_dir(str(tmp_path), parts)  # this run's own shard: resumed
    (tmp_path / "shard-0000-of-0003.trace").write_text("")
    with pytest.raises(rc.RayUnavailable, match="not a shard of this run"):
        rc.check_shard_dir(str(tmp_path), parts)


def test_ray_settings_are_checked():
    from ds4eval.config import ConfigError

    with pytest.raises(ConfigError, match="--ray needs --trace"):
        EvalConfig(ray="").validate()
    with pytest.raises(ConfigError, match="--ray makes its own shards"):
        EvalConfig(ray="", trace="t", shard="0/2").validate()
    with pytest.raises(ConfigError, match="--ray-shards"):
        EvalConfig(ray_shards=2).validate()
