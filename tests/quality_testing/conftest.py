"""Fixtures for the quality tests: the repository root on sys.path and one packed model per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# quality_testing/ is a folder of scripts, not an installed package: make it importable
# however pytest was started.
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def embedded_sha(embedded_path):
    from quality_testing.refset import sha256_file

    return sha256_file(embedded_path)


@pytest.fixture(scope="session")
def packed_model(embedded_path):
    """The embedded model on the CPU fast path (packed weights), full context."""
    from engine import load_model

    return load_model(embedded_path, device="cpu", weights="packed")
