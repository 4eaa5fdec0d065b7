"""The server's heap settings (`server.heap`): the arena bound and the trim after large requests."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from server import heap
from server_fake_engine import FakeModel
from server_support import fake_app

glibc = pytest.mark.skipif(not heap.AVAILABLE, reason="malloc is not glibc's")


@glibc
def test_the_arena_bound_is_the_environments_when_it_sets_one(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    assert heap.limit_arenas() == 3
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert heap.limit_arenas(heap.DEFAULT_ARENAS) == heap.DEFAULT_ARENAS
    assert heap.trim() in (True, False)


@glibc
def test_a_large_request_is_followed_by_one_trim(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(time.monotonic()) or True)
    with TestClient(fake_app(FakeModel()), raise_server_exceptions=False) as c:
        small = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert small.status_code == 200
        time.sleep(0.2)
        assert calls == []
        big = "word " * (heap.DEFAULT_TRIM_BYTES // 5)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}], "max_tokens": 1})
        assert r.status_code == 400  # cannot fit the context
        deadline = time.monotonic() + 10
        while not calls:
            assert time.monotonic() < deadline, "no trim after a large request"
            time.sleep(0.02)
    assert len(calls) == 1
