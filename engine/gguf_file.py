"""Read a GGUF file once into immutable records: metadata values and tensor descriptors.

`read_gguf(path)` parses the header, the key/value metadata and the tensor table, and
memory-maps the file so tensor data stays a zero-copy uint8 view until a loader converts
it.  Metadata values come back as plain Python values, the same as
`gguf.GGUFReader(path).fields[key].contents()` (the tests hold this reader to that oracle);
the parsing is done here because GGUFReader builds a numpy view per array element, which
takes seconds on a 49K-token vocabulary, against milliseconds here (strings are cut from a
bytes copy of the file's head, an array of them in one loop).  Type codes and block
sizes come from the `gguf` package.  Errors (missing file, not a GGUF, truncated or
malformed) surface as `GGUFError` with the path in the message; a file cut short says so in
file terms ("file ends at byte N but tensor X needs bytes up to M: truncated download?").

File layout (little-endian): b"GGUF" | u32 version (2 or 3) | u64 n_tensors | u64 n_kv |
n_kv x (string key, u32 type, value) | n_tensors x (string name, u32 n_dims, u64 dims[n_dims]
(innermost first), u32 type, u64 offset) | padding to `general.alignment` (default 32) |
tensor data, each tensor at data_start + offset.  A string is u64 length + UTF-8 bytes; an
array is u32 element type + u64 count + elements.

Which keys and tensors the engine reads (the GGUF mapping):
  general.architecture, general.name                         -> ModelConfig.arch, model name
  {arch}.block_count / context_length / embedding_length /
  feed_forward_length / attention.head_count(_kv) /
  attention.key_length / attention.layer_norm_rms_epsilon /
  rope.freq_base / rope.dimension_count / vocab_size         -> ModelConfig fields
  tokenizer.ggml.* and tokenizer.chat_template                -> engine.tokenizer / engine.chat_template
  token_embd, output_norm, output (optional: tied to token_embd when absent), rope_freqs
  (optional per-dimension frequency factors), and per block N: blk.N.attn_norm,
  attn_q/k/v (+ .bias), attn_q_norm/attn_k_norm, attn_output, ffn_norm, ffn_gate/up/down.
It does not interpret the tensors; see engine.quants and engine.weights.
"""
from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class GGUFError(Exception):
    """The file is missing, unreadable or not a valid GGUF."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows, cols) for matrices, i.e. GGUF's dims reversed
    data: np.ndarray  # the tensor's raw bytes (uint8, zero-copy view of the file)

    @property
    def n_cols(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class GGUFContents:
    path: str
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorRecord]
    file_size: int


# Value type code -> numpy dtype for the fixed-size scalar types.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class Truncated(ValueError):
    """The file ends before a part that its header describes: almost always a cut-off download."""

    def __init__(self, size: int, what: str, needed: int):
        super().__init__(f"file ends at byte {size} but {what} needs bytes up to {needed}: truncated download?")


# How much of the file's head the cursor copies at first; it doubles while the metadata and
# tensor table run past it (a 49K-token vocabulary takes about 2 MB).
_HEAD_BYTES = 1 << 20

_U64 = struct.Struct("<Q")
_struct = functools.cache(struct.Struct)


class _Cursor:
    """Reads the metadata and the tensor table from a bytes copy of the file's head.

    Slicing and decoding a bytes object is the fastest way Python has to cut tens of
    thousands of strings out of a buffer, faster than slicing the memory map itself.  The
    copy doubles on demand, so it holds at most twice what the parser has read: the head,
    never the bulk of the tensor data.
    """

    def __init__(self, file: memoryview):
        self.file = file
        self.size = len(file)
        self.head = bytes(file[:_HEAD_BYTES])
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        """Raise a truncation error in file terms when `what` needs n bytes past the cursor;
        otherwise make sure the head copy holds them."""
        end = self.pos + n
        if end > len(self.head):
            if end > self.size:
                raise Truncated(self.size, what, end)
            self.head = bytes(self.file[:max(end, 2 * len(self.head))])

    def take(self, fmt: str, what: str = "the header") -> Any:
        form = _struct(fmt)
        self.need(form.size, what)
        value = form.unpack_from(self.head, self.pos)
        self.pos += form.size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings stored back to back (u64 length + UTF-8 bytes each), invalid UTF-8
        replaced by U+FFFD.  One loop on local names: a vocabulary is ~100K strings, and a
        method call per string would cost more than the decoding."""
        out: list[str] = []
        append = out.append
        unpack = _U64.unpack_from
        head, pos = self.head, self.pos
        limit = len(head)
        for _ in range(count):
            if pos + 8 > limit:
                self.pos = pos
                self.need(8, "the header")
                head = self.head
                limit = len(head)
            (n,) = unpack(head, pos)
            start = pos + 8
            pos = start + n
            if pos > limit:
                self.pos = start
                self.need(pos - start, "a metadata string")
                head = self.head
                limit = len(head)
            append(head[start:pos].decode("utf-8", "replace"))
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            if etype not in _SCALARS:
                raise ValueError(f"unknown metadata array element type {etype}")
            dt = np.dtype(_SCALARS[etype])
            self.need(count * dt.itemsize, "a metadata array")
            arr = np.frombuffer(self.head, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        dt = np.dtype(_SCALARS[vtype])
        self.need(dt.itemsize, "a metadata value")
        v = np.frombuffer(self.head, dtype=dt, count=1, offset=self.pos)[0]
        self.pos += dt.itemsize
        return bool(v) if vtype == _BOOL else v.item()


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"model file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(data))
        cur.pos = 4
        version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                    "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("<I")
            dims = [cur.take("<Q") for _ in range(n_dims)]
            infos.append((name, dims, GGMLQuantizationType(cur.take("<I")), cur.take("<Q")))
        align = int(metadata.get("general.alignment", 32))
        start = (cur.pos + align - 1) // align * align
        tensors = {}
        for name, dims, qtype, offset in infos:
            block, nbytes = GGML_QUANT_SIZES[qtype]
            n_elem = math.prod(dims)
            length = n_elem // block * nbytes
            begin = start + offset
            if begin + length > size:
                raise Truncated(size, f"tensor {name}", begin + length)
            tensors[name] = TensorRecord(name, qtype, tuple(int(d) for d in reversed(dims)),
                                         data[begin: begin + length])
    except Truncated as e:
        raise GGUFError(f"cannot read GGUF {path}: {e}") from None
    except (ValueError, struct.error, OverflowError, KeyError, UnicodeDecodeError) as e:
        raise GGUFError(f"cannot read GGUF {path}: {e}") from None
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e}") from None
    return GGUFContents(path=path, metadata=metadata, tensors=tensors, file_size=size)
