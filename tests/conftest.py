"""Fixtures shared by every test folder, and a collection check: test ids are unique."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """Refuse a collection in which two items share an id: pytest-xdist (`make test`) runs a single
    item per id, so the others would pass without running."""
    shared = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if shared:
        raise pytest.UsageError(f"{len(shared)} test id(s) name more than one test, e.g. {shared[0]}; "
                                "give each its own id (pytest.param(..., id=...))")


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
