"""ds4eval.atomicfile: the old file survives a failed write; no temporary files are left."""
from __future__ import annotations

import os

import pytest

from ds4eval.atomicfile import atomic_open, atomic_path, write_text_atomic


def test_write_replaces_and_keeps_suffix(tmp_path):
    target = tmp_path / "out.csv"
    write_text_atomic(target, "a\n")
    write_text_atomic(target, "b\n")
    assert target.read_text() == "b\n" and os.listdir(tmp_path) == ["out.csv"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    with atomic_path(tmp_path / "x.npz") as tmp:
        assert tmp.endswith(".npz") and os.path.dirname(tmp) == str(tmp_path)
        open(tmp, "wb").close()


def test_failure_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "data.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_open(target) as f:
            f.write("half of the new")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["data.json"]


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "nope" / "f.txt", "x")
