"""engine.gguf_file against gguf-py's GGUFReader, the reference parser."""
from __future__ import annotations

import struct

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


def _gguf_string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _metadata_only_gguf(strings: list[bytes]) -> bytes:
    """A GGUF v3 file with no tensors and two keys: "strings", an array of `strings`, then
    "after", a plain string (the parser has to land exactly behind the array)."""
    array = struct.pack("<IQ", 8, len(strings)) + b"".join(map(_gguf_string, strings))
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
            + _gguf_string(b"strings") + struct.pack("<I", 9) + array
            + _gguf_string(b"after") + struct.pack("<I", 8) + _gguf_string(b"end"))


def test_string_arrays(tmp_path):
    """Empty strings, non-ASCII UTF-8 and invalid UTF-8 (replaced, as `bytes.decode` with
    errors="replace" does) read the same at any position of an array, also one too long for
    the first copy of the file's head."""
    odd = [b"", b"plain", "é日😀Ġ".encode(), b"\xff\xfe", b"cut \xe6\x97", b"\xc3", b"\x80x", b"\x00 nul"]
    strings = odd + [b"%d" % i * (i % 7) for i in range(300_000)] + odd
    p = tmp_path / "strings.gguf"
    data = _metadata_only_gguf(strings)
    assert len(data) > 2 << 20
    p.write_bytes(data)
    meta = read_gguf(p).metadata
    assert meta["strings"] == [s.decode("utf-8", errors="replace") for s in strings]
    assert meta["after"] == "end"
    assert meta["strings"][3:8] == ["\ufffd\ufffd", "cut \ufffd", "\ufffd", "\ufffdx", "\x00 nul"]

    # Cut inside a string and inside a length, both past the first head copy.
    array_at = 24 + len(_gguf_string(b"strings")) + 4 + 12  # header, key, value type, element type + count
    end = array_at + sum(8 + len(s) for s in strings[:-4])  # the fourth string from the end: its length
    for cut, what, needed in ((end - 1, "a metadata string", end), (end + 3, "the header", end + 8)):
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=f"file ends at byte {cut} but {what} needs bytes up to {needed}:"):
            read_gguf(p)
