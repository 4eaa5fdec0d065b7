"""Fixtures shared by the benchmark tests."""
from __future__ import annotations

import pytest

from engine.synthetic import RandomModelSpec, write_random_gguf


@pytest.fixture(scope="session")
def untied(tmp_path_factory) -> str:
    """A random model whose greedy tokens vary (a tied random one mostly repeats its last id)."""
    spec = RandomModelSpec(seed=3, tied_output=False, qtype="Q8_0")
    return write_random_gguf(tmp_path_factory.mktemp("bench") / "untied.gguf", spec)
