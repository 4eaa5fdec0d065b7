"""Shared fixtures for ds4eval tests: where the external case data lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def eval_data_dir() -> Path:
    env = os.environ.get("DS4EVAL_DATA")
    return Path(env) if env else (REPO.parent / "shared" / "eval-data")


@pytest.fixture
def data_dir() -> Path:
    d = eval_data_dir()
    if not (d / "core.jsonl").is_file():
        pytest.skip(f"eval data not found in {d}")
    return d


@pytest.fixture
def measures_counting():
    """Asked for by a test whose runs measure a server's counting rule for real (see below)."""


@pytest.fixture(autouse=True)
def no_counting_measurement(request, monkeypatch):
    """Keep a run's provenance from sending its counting-rule requests (`countrule`) to the fake
    servers, whose request logs the tests read, unless the test asks for `measures_counting`."""
    if "measures_counting" in request.fixturenames:
        return
    from ds4eval.run import countrule

    monkeypatch.setattr(countrule, "measure_eos_counting", lambda endpoint, model, api_key=None: "")
