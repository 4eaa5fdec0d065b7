"""Fixtures shared by every test folder."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_path() -> str:
    """Path of the embedded model's GGUF; the test is skipped when it is not installed."""
    from engine import ModelLoadError, default_model_path

    try:
        path = default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))
    if not Path(path).is_file():
        pytest.skip(f"embedded model not found at {path}")
    return path
