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
