"""The disk KV cache against a hostile or damaged directory: FIFOs and links named like
entries, stale temporary files, entries under a wrong name, the directory's mode.

Startup with a FIFO runs in a subprocess with a timeout, so that a scan that blocks fails
the test instead of hanging it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from server import kvstore as kv
from server.kvstore import KVStore, ModelIdentity
from server.kvstore_policy import COLD

REPO = Path(__file__).resolve().parents[2]
IDENT = ModelIdentity("tiny#0123456789abcdef", "Q4_1", 256)


def payload(n_tokens: int) -> bytes:
    import struct
    head = struct.pack("<6sHBxIIII", b"DS4KV\0", 1, 0, 1, 1, 1, n_tokens)
    return head + struct.pack(f"<{n_tokens}i", *range(1, n_tokens + 1)) + bytes(64)


def key_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


OPEN_STORE = textwrap.dedent("""
    import sys, time
    from server.kvstore import KVStore, ModelIdentity
    t = time.monotonic()
    store = KVStore(sys.argv[1], ModelIdentity("tiny#0123456789abcdef", "Q4_1", 256))
    print(len(store.entries()), round(time.monotonic() - t, 3))
""")


def test_a_fifo_named_like_an_entry_does_not_block_startup(tmp_path):
    d = tmp_path / "kv"
    KVStore(d, IDENT).store("good", payload(2), COLD)
    os.mkfifo(d / f"{key_of('fifo')}.kv")
    os.mkfifo(d / f"{key_of('fifo2')}.kv.tmp.1")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", OPEN_STORE, str(d)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    n, seconds = r.stdout.split()
    assert int(n) == 1 and float(seconds) < 5
    assert "not a regular file" in r.stderr
    assert stat.S_ISFIFO(os.lstat(d / f"{key_of('fifo')}.kv").st_mode)  # not ours to delete


def test_a_symlink_named_like_an_entry_is_not_followed(tmp_path, caplog):
    d = tmp_path / "kv"
    entry = KVStore(d, IDENT).store("good", payload(2), COLD)
    os.symlink(d / f"{entry.key}.kv", d / f"{key_of('elsewhere')}.kv")
    with caplog.at_level(logging.WARNING, logger="ds4.server.kvstore"):
        store = KVStore(d, IDENT)
    assert [e.key for e in store.entries()] == [entry.key]


def test_an_entry_replaced_by_a_fifo_after_the_scan_does_not_block_a_lookup(tmp_path):
    d = tmp_path / "kv"
    store = KVStore(d, IDENT)
    entry = store.store("a prefix", payload(3), COLD)
    path = d / f"{entry.key}.kv"
    path.unlink()
    os.mkfifo(path)
    result = []
    t = threading.Thread(target=lambda: result.append(store.lookup("a prefix and more")), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and result == [None]


def test_stale_temp_files_are_removed_and_logged(tmp_path, caplog):
    d = tmp_path / "kv"
    d.mkdir()
    fresh = d / f"{'1' * 40}.kv.tmp.{os.getpid()}"
    old = d / f"{'2' * 40}.kv.tmp.{os.getpid()}"
    for p in (fresh, old):
        p.write_bytes(b"partial")
    long_ago = time.time() - kv.TEMP_MAX_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    with caplog.at_level(logging.INFO, logger="ds4.server.kvstore"):
        KVStore(d, IDENT)
    assert fresh.exists() and not old.exists()
    assert any("temporary file" in r.message and old.name in r.message for r in caplog.records)


def test_a_valid_entry_under_a_wrong_name_is_deleted_at_the_scan(tmp_path):
    d = tmp_path / "kv"
    entry = KVStore(d, IDENT).store("the real text", payload(4), COLD)
    wrong = d / f"{key_of('another text')}.kv"
    os.rename(d / f"{entry.key}.kv", wrong)
    store = KVStore(d, IDENT)
    assert store.entries() == [] and store.stats().bytes == 0
    assert not wrong.exists() and store.stats().deleted_bad == 1


def test_the_directory_and_files_are_private(tmp_path, caplog):
    d = tmp_path / "kv"
    old_umask = os.umask(0)
    try:
        store = KVStore(d, IDENT)
        entry = store.store("text", payload(2), COLD)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / f"{entry.key}.kv").st_mode) == 0o600
    os.chmod(d, 0o777)
    with caplog.at_level(logging.WARNING, logger="ds4.server.kvstore"):
        KVStore(d, IDENT)
    assert any("other users" in r.message for r in caplog.records)


@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_WRONLY])
def test_open_regular_refuses_a_fifo_without_blocking(tmp_path, flags):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        kv.open_regular(str(fifo), flags)


# --- the temporary file of a write ------------------------------------------------------------

@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path, link, caplog):
    d = tmp_path / "kv"
    store = KVStore(d, IDENT, 10**9)
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"must not change")
    key = key_of("a prefix")
    planted = d / f"{key}.kv.tmp.{os.getpid()}"
    (planted.symlink_to if link == "symlink" else planted.hardlink_to)(victim)
    with caplog.at_level(logging.WARNING, logger="ds4.server.kvstore"):
        entry = store.store("a prefix", payload(3), COLD)
    assert entry is not None and store.lookup("a prefix and more").payload == payload(3)
    assert victim.read_bytes() == b"must not change"
    assert not planted.exists() and not planted.is_symlink()
    assert any("already exists" in r.message for r in caplog.records)


def test_the_temporary_file_is_created_exclusively(tmp_path, monkeypatch):
    """O_EXCL and O_NOFOLLOW on every create, not only when something is in the way."""
    seen: list[int] = []
    real_open = os.open

    def spy(path, flags, *args):
        if ".kv.tmp." in os.fspath(path):
            seen.append(flags)
        return real_open(path, flags, *args)

    store = KVStore(tmp_path / "kv", IDENT, 10**9)
    monkeypatch.setattr(os, "open", spy)
    store.store("text", payload(2), COLD)
    assert seen and all(f & os.O_CREAT and f & os.O_EXCL and f & os.O_NOFOLLOW and not f & os.O_TRUNC
                        for f in seen)


# --- one process per directory ---------------------------------------------------------------

OPEN_AND_REPORT = textwrap.dedent("""
    import sys
    from server.kvstore import DirectoryInUse, KVStore, ModelIdentity
    try:
        KVStore(sys.argv[1], ModelIdentity("tiny#0123456789abcdef", "Q4_1", 256))
    except DirectoryInUse as e:
        print("refused:", e)
    else:
        print("opened")
""")


def open_elsewhere(d: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", OPEN_AND_REPORT, str(d)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_second_process_cannot_open_a_directory_that_a_store_holds(tmp_path):
    d = tmp_path / "kv"
    store = KVStore(d, IDENT, 10**9)
    also = KVStore(d, IDENT, 10**9)  # the same process: the tools and tests beside a server
    answer = open_elsewhere(d)
    assert answer.startswith("refused:") and f"pid {os.getpid()}" in answer and kv.LOCK_NAME in answer
    store.close()
    assert open_elsewhere(d).startswith("refused:")  # `also` still holds it
    also.close()
    assert open_elsewhere(d) == "opened"


def test_a_dropped_store_lets_go_of_its_directory(tmp_path):
    d = tmp_path / "kv"
    KVStore(d, IDENT, 10**9).store("x", payload(2), COLD)
    assert open_elsewhere(d) == "opened"


def test_a_lock_name_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    os.mkfifo(d / kv.LOCK_NAME)
    with pytest.raises(kv.NotRegularFile):
        KVStore(d, IDENT, 10**9)
