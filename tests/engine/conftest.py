"""Fixtures for engine tests: tiny random GGUF models written once per session."""
from __future__ import annotations

import zlib

import pytest

from engine.synthetic import RandomModelSpec, write_random_gguf

K_QUANTS = {"Q4_K", "Q6_K"}


def tiny_spec(arch: str, qtype: str, **kw) -> RandomModelSpec:
    wide = qtype in K_QUANTS  # k-quant blocks span 256 columns
    base = dict(arch=arch, qtype=qtype, n_embd=256 if wide else 64, n_ff=512 if wide else 128,
                n_head=4, n_head_kv=2, n_layer=2, n_ctx=256, tied_output=qtype != "Q8_0", seed=zlib.crc32(f"{arch}{qtype}".encode()) % 1000)
    base.update(kw)
    return RandomModelSpec(**base)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, qtype, **spec) -> path of a cached random model."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict = {}

    def make(arch: str = "llama", qtype: str = "Q4_1", **kw) -> str:
        key = (arch, qtype, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = write_random_gguf(root / f"{arch}-{qtype}-{len(made)}.gguf", tiny_spec(arch, qtype, **kw))
        return str(made[key])

    return make
