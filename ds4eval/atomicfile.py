"""Write files so that readers see the old content or the new, never half of either.

`atomic_path(path)` yields a temporary path in the same directory (same suffix, so writers
that pick a format by extension still work); when the block ends normally the temporary file
is renamed over `path`, otherwise it is removed.  `atomic_open` and `write_text_atomic` are
the common cases on top of it.  Files get mode 0644 (mkstemp's 0600 is meant for secrets;
reports and data are meant to be shared).  It does not fsync: these are reports and data
files that can be regenerated, not a cache that must survive power loss (server.kvstore
does its own fsync).
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import IO, Iterator


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=os.path.splitext(path)[1],
                               dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", newline="") as f:
        f.write(text)
