"""Fixtures for the server tests; the helpers behind them live in server_support.py."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from server_fake_engine import FakeModel
from server_support import fake_app


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A disk KV cache directory, not created yet."""
    return tmp_path / "kv"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random GGUF model (`engine.synthetic`) of 256 tokens of context, one per test module."""
    from engine import load_model
    from engine.synthetic import RandomModelSpec, write_random_gguf

    path = write_random_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", RandomModelSpec(n_ctx=256, seed=7))
    return load_model(path)


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    """A one-layer random GGUF with the embedded model's tokenizer (its 49,152-token vocabulary and
    chat template) and 2,048 tokens of context: what per-token host work sees, without weights."""
    from engine import load_model
    from engine.model import default_model_path
    from engine.synthetic import RandomModelSpec, write_random_gguf

    path = write_random_gguf(tmp_path_factory.mktemp("gguf") / "vocab.gguf",
                             RandomModelSpec(n_layer=1, n_ctx=2048, tokenizer_from=default_model_path()))
    return load_model(path)


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def client(fake_model: FakeModel) -> Iterator[TestClient]:
    with TestClient(fake_app(fake_model), raise_server_exceptions=False) as c:
        yield c
