"""The random GGUFs a test module shares: each written once per distinct arguments, in a
temporary folder the module's fixture owns.  It writes no GGUF itself (the family's writer does)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


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
