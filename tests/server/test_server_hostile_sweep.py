"""The held-out hostile set (`hostile_sweep.py`) never gets a 5xx from ds4-server, and the server
serves normally afterwards: the fast subset against the real command line with the fake engine
(no weights), the full sweep against the embedded model in both loops (`slow`)."""

from __future__ import annotations

import pytest

from hostile_sweep import SERVER_FLAGS, cases, counts, fivexx, sweep
from server_support import model_server_process, server_process


def test_every_family_is_in_the_fast_subset():
    families = {name.split("/")[0] for name, _ in cases(fast=True)}
    assert families == {"json", "fields", "framing", "stream", "schema", "tools", "tokens", "messages", "storm"}
    assert len(cases(fast=False)) > len(cases(fast=True))


def test_the_fast_hostile_subset_gets_no_5xx(tmp_path):
    with server_process(tmp_path / "server.log", *SERVER_FLAGS) as srv:
        seen = sweep(srv.base, fast=True)
        alive = srv.proc.poll() is None
    assert not fivexx(seen), fivexx(seen)
    assert seen["after/normal"] == [200] and alive
    assert sum(counts(seen).values()) > 500  # the sweep really fired its requests
    assert all(statuses for statuses in seen.values())


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 2], ids=["serial", "batched2"])
def test_the_full_hostile_sweep_gets_no_5xx_from_the_embedded_model(slots):
    with model_server_process("--batched-session", str(slots), "--log-level", "warning", *SERVER_FLAGS) as srv:
        seen = sweep(srv.base, fast=False)
        alive = srv.proc.poll() is None
    print(f"\n{len(seen)} cases, status counts {dict(sorted(counts(seen).items()))}")
    assert not fivexx(seen), fivexx(seen)
    assert seen["after/normal"] == [200] and alive
