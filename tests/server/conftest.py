"""Fixtures for the server tests; the helpers behind them live in server_support.py."""

from __future__ import annotations

from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from server_fake_engine import FakeModel
from server_support import fake_app


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def client(fake_model: FakeModel) -> Iterator[TestClient]:
    with TestClient(fake_app(fake_model), raise_server_exceptions=False) as c:
        yield c
