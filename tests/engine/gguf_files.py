"""The GGUFs a test module shares: random ones, each written once per distinct arguments, in a
temporary folder the module's fixture owns (the family's writer writes them), and a real
model's copy with its layer matrices in another type (`retyped_copy`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np


def file_maker(root: Path, write: Callable[[Path, str, str, dict], Any], kind: str, qtype: str) -> Callable[..., Any]:
    """make(kind, qtype, **spec) -> what `write(path, kind, qtype, spec)` returns, written once per
    distinct arguments under `root`: the random GGUFs a test module shares.  `kind` and `qtype`
    are the defaults."""
    made: dict = {}

    def make(kind: str = kind, qtype: str = qtype, **kw) -> Any:
        key = (kind, qtype, repr(sorted(kw.items())))  # repr: a spec may hold a dict (extra_metadata)
        if key not in made:
            made[key] = write(root / f"{kind}-{qtype}-{len(made)}.gguf", kind, qtype, kw)
        return made[key]

    return make


def retyped_copy(src: str, dst: str, qtype: str) -> str:
    """`src` with its layer matrices (blk.*, two-dimensional) dequantized and written in
    `qtype` (one gguf-py quantizes: F16, F32, Q8_0, Q4_0, ...); every other tensor and all
    metadata as they are.  A source for llama.cpp's own quantizer, which needs float weights."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter
    from gguf import quants as gq

    from engine.gguf_file import read_gguf
    from engine.quants import dequantize
    from engine.synthetic import add_metadata

    g = read_gguf(src)
    target = QT[qtype]
    tmp = f"{dst}.tmp.{os.getpid()}"
    w = GGUFWriter(tmp, g.metadata["general.architecture"])
    add_metadata(w, {k: v for k, v in g.metadata.items() if not k.startswith("GGUF.") and k != "general.architecture"})
    for name, r in g.tensors.items():
        data = np.asarray(r.data)
        if name.startswith("blk.") and len(r.shape) == 2:
            w.add_tensor(name, gq.quantize(dequantize(r.qtype, r.data, r.n_cols).reshape(r.shape), target),
                         raw_dtype=target)
        else:
            w.add_tensor(name, data.view(np.uint8).reshape(r.shape[0], -1) if len(r.shape) == 2 else data,
                         raw_dtype=r.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst
