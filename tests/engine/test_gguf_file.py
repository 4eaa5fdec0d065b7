"""engine.gguf_file against gguf-py's GGUFReader, the reference parser."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from engine import default_model_path
from engine.gguf_file import GGUFError, read_gguf


def same_as_reference(path: str) -> None:
    ref = GGUFReader(path)
    mine = read_gguf(path)
    assert {k: f.contents() for k, f in ref.fields.items()} == dict(mine.metadata)
    assert [t.name for t in ref.tensors] == list(mine.tensors)
    for t in ref.tensors:
        rec = mine.tensors[t.name]
        assert rec.qtype == t.tensor_type
        assert rec.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1), rec.data)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_matches_gguf_reader(tiny_gguf, qtype):
    same_as_reference(tiny_gguf("qwen2", qtype))


@pytest.mark.model
def test_matches_gguf_reader_on_embedded_model():
    same_as_reference(default_model_path())


def test_truncated_and_corrupt_files(tiny_gguf, tmp_path):
    data = open(tiny_gguf("llama", "Q4_1"), "rb").read()
    for n, cut in enumerate([12, 200, len(data) - 100]):
        p = tmp_path / f"cut{n}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError):
            read_gguf(p)
    bad = bytearray(data)
    bad[4:8] = (99).to_bytes(4, "little")  # version
    p = tmp_path / "version.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(GGUFError, match="version 99"):
        read_gguf(p)


def test_truncation_is_reported_in_file_terms(tiny_gguf, tmp_path):
    """A cut-off download names the file size and the part that needs more bytes, not a
    struct error."""
    data = open(tiny_gguf("llama", "Q4_1"), "rb").read()
    ref = read_gguf(tiny_gguf("llama", "Q4_1"))
    last = max(ref.tensors.values(), key=lambda t: t.data.ctypes.data)
    for cut in (12, 30, 200, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as err:
            read_gguf(p)
        msg = str(err.value)
        assert f"file ends at byte {cut} but " in msg and "truncated download?" in msg
        assert "unpack_from" not in msg and "buffer" not in msg
    p = tmp_path / "tail.gguf"
    p.write_bytes(data[:-100])
    with pytest.raises(GGUFError, match=f"tensor {last.name} needs bytes up to {len(data)}"):
        read_gguf(p)
