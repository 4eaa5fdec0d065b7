"""Disk KV cache: prefix checkpoints of engine sessions, kept in one directory.

`KVStore(directory, identity, budget_bytes)` indexes the `*.kv` files of a directory (headers
only, so a restarted server finds its entries at once) and offers:
  lookup(rendered_text, longer_than=0) -> Hit | None
      the entry whose prefix text is the longest byte prefix of `rendered_text`, verified
      (header, content hash, text) before it is returned; its hit count and last-used time
      are updated. The caller restores `hit.payload` into a session and tokenizes only
      `rendered_text[len(hit.prefix_text):]`.
  store(prefix_text, session_or_payload, reason, replay_trailer=b"") -> Entry | None
      first evicts entries until the filesystem has room for the checkpoint plus
      `min_free_bytes` (`os.statvfs`), writes it atomically, then evicts other entries until
      the directory fits the budget (see `server.kvstore_policy`). None when the entry alone
      would not fit in 99% of the budget, when evicting every other entry would not leave the
      minimum free (nothing is evicted then), or when the write failed: each is one log line
      and a counter, and the cache never fails a request.
  stats() -> KVStoreStats, entries() -> list[Entry], close()
`open_store(config, model)` builds the store for the server flags. The inference loops use it
through `server.kvplan` (restore, checkpoint stages, saving a resident session), which applies
the save policy of `server.kvstore_policy` (`KVStore.save_policy`).
Entries are keyed by the SHA-1 of the UTF-8 prefix text: file `<40 hex digits>.kv`. A lookup
hashes the prompt once, incrementally, at each distinct prefix length in the index, so the
texts themselves need not be held in memory.

File format, version 1 (all integers little-endian; offsets in bytes):
     0  8   magic  b"DS4KVDSK"
     8  2   u16 format version (1)
    10  1   u8  save reason: 1 cold, 2 continued, 3 evict, 4 shutdown
    11  1   u8  reserved, 0
    12  4   u32 header size (184)
    16 64   model id, UTF-8, NUL-padded (`ModelIdentity.model_id`)
    80 16   quantization, ASCII, NUL-padded (e.g. "Q4_1")
    96  4   u32 context size the session was made with
   100  4   u32 token count of the checkpoint
   104  4   u32 prefix text length in bytes (T)
   108  4   u32 reserved, 0
   112  8   u64 payload length (P)
   120  8   u64 trailer length (R)
   128  8   f64 created, Unix seconds
   136  4   u32 hit count                  \\ the mutable part: rewritten in place on
   140  4   u32 reserved, 0                 | every restore, so it is not hashed (a torn
   144  8   f64 last used, Unix seconds    /  update only skews eviction)
   152 32   SHA-256 of bytes 0..136, then the text, the payload and the trailer
   184  T   prefix text, UTF-8
 184+T  P   session payload (`engine.Session.save_payload()`; its token ids are read
            from it: b"DS4KV\\0", u16 version 1 or 2, ..., u32 n_tokens at offset 20, then
            i32 ids at offset 24; version 2, for a cache with a sliding-window ring, keeps
            only the window of those layers, so P is that much smaller)
  ...   R   trailer: opaque bytes for tool replay memory, empty when R = 0
The file size is exactly 184 + T + P + R.

Safety: a file is written as `<name>.tmp.<pid>` (mode 0600), fsynced, renamed over `<name>`
and the directory fsynced, so a reader sees a whole file or none. The temporary file is
created with O_CREAT|O_EXCL|O_NOFOLLOW: whatever already has its name (a symbolic or hard
link planted there, the leftover of a crashed process whose PID came back) is unlinked, never
written through, and the exclusive create is tried once more. When a store opens, temporary
files of processes that no longer run are deleted, and so are those of live processes once
they are older than `TEMP_MAX_AGE_S` (no write takes that long; the PID may have been reused),
each with a log line. A file whose header does not match the running model (model id,
quantization, context size), whose version, size or hash is wrong, whose name is not the SHA-1
of its text (checked at the scan too, so that a misnamed entry takes no budget), or whose
payload disagrees with its header, is deleted and never used.

One process per directory: a store takes an exclusive `fcntl.flock` on `<directory>/.ds4kv.lock`
(the file holds the owner's PID) and keeps it until it is closed or the process ends; a store
of another process on the same directory raises `DirectoryInUse` (an OSError) with that PID,
so a second ds4-server refuses to start with one line instead of keeping an index of its own
beside the first one's. Stores of one process share the lock (`claim_directory`), so a
server's command line can claim the directory before its model loads and tools and tests can
open the directory the server of their own process uses. The lock file is left in place: a
lock held on a file that another process may delete and re-create would not exclude anything.

Only regular files are opened: every open is non-blocking and checked with `fstat`, so a
FIFO, socket or device named like an entry is skipped with a log line instead of blocking the
scan (or a lookup) forever; symbolic links are not followed.

Trust: the directory is created with mode 0700 (a warning is logged when an existing one is
readable or writable by others). Its contents are trusted: the content hash guards against
torn writes and accidents, not forgery — whoever can write to the directory can make the
server restore any KV state they like.

It is storage only: it does not decide when to save (`server.kvstore_policy` does), plan or run
prefills (`server.kvplan` does), import the engine (models and sessions are used through their
methods), or know anything of HTTP.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from server import kvstore_policy as policy

log = logging.getLogger("ds4.server.kvstore")

MAGIC = b"DS4KVDSK"
VERSION = 1
SUFFIX = ".kv"
_FIXED = struct.Struct("<8sHBBI64s16sIIIIQQd")  # bytes 0..136: immutable, hashed
_MUTABLE = struct.Struct("<IId")  # bytes 136..152: hit count, reserved, last used
HASH_SIZE = 32
HEADER_SIZE = _FIXED.size + _MUTABLE.size + HASH_SIZE
assert _FIXED.size == 136 and HEADER_SIZE == 184

REASON_CODES = {policy.COLD: 1, policy.CONTINUED: 2, policy.EVICT: 3, policy.SHUTDOWN: 4}
REASON_NAMES = {v: k for k, v in REASON_CODES.items()}

_PAYLOAD_MAGIC = b"DS4KV\0"
_PAYLOAD_HEAD = struct.Struct("<6sHBxIIII")
_PAYLOAD_VERSIONS = (1, 2)  # both keep the token ids at the same place
MIB = 1 << 20
# A temporary file older than this is left over from a crash even when its PID runs again.
TEMP_MAX_AGE_S = 3600.0
DEFAULT_BUDGET_MB = 4096
DEFAULT_MIN_FREE_MB = 1024
LOCK_NAME = ".ds4kv.lock"
_WRITE_CHUNK = 4 * MIB


class EntryError(ValueError):
    """A cache file that must not be used; the message says why."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint must match to be restored into a session of the running model."""
    model_id: str
    quant: str
    n_ctx: int


def model_fingerprint(path: str, name: str = "") -> str:
    """A model id that changes when the GGUF does: its name and a hash of its size, head and tail.

    Reads at most 2 MiB: the head holds the metadata and tensor table, the tail the last
    weights, so a re-quantized or fine-tuned file of the same name gets another id.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(MIB))
        if size > 2 * MIB:
            f.seek(size - MIB)
            h.update(f.read(MIB))
    label = (name or os.path.basename(path)).encode("utf-8")[:40].decode("utf-8", "ignore")
    return f"{label}#{h.hexdigest()[:20]}"


def identity_of(model: Any) -> ModelIdentity:
    """The identity of an engine `Model` (name, GGUF contents, quantization, context size)."""
    return ModelIdentity(model_fingerprint(model.path, model.name), str(model.quant), int(model.n_ctx))


@dataclass(frozen=True)
class KVStoreConfig:
    """Disk cache settings; each field is one ds4-server flag."""
    directory: str | None = None  # --kv-disk-dir; None: no disk cache
    budget_mb: int = DEFAULT_BUDGET_MB  # --kv-cache-budget-mb, in MiB
    min_free_mb: int = DEFAULT_MIN_FREE_MB  # --kv-min-free-mb: free space a save must leave on the filesystem

    def __post_init__(self) -> None:
        if self.min_free_mb < 0:
            raise ValueError(f"kv_min_free_mb must be at least 0, got {self.min_free_mb}")

    @property
    def budget_bytes(self) -> int:
        return self.budget_mb * MIB

    @property
    def min_free_bytes(self) -> int:
        return self.min_free_mb * MIB


@dataclass(frozen=True)
class Entry:
    """One indexed file (header fields; the text and payload stay on disk)."""
    key: str
    reason: str
    n_tokens: int
    text_len: int
    file_size: int
    hits: int
    created: float
    last_used: float

    def stats(self) -> policy.EntryStats:
        return policy.EntryStats(self.key, self.reason, self.n_tokens, self.file_size, self.hits, self.last_used)


@dataclass(frozen=True)
class Hit:
    """A verified checkpoint: restore `payload`, then feed the tokens of the text after `prefix_text`."""
    key: str
    prefix_text: str
    tokens: tuple[int, ...]
    payload: bytes
    trailer: bytes
    reason: str
    hits: int

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class KVStoreStats:
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    tokens_restored: int = 0
    bytes_restored: int = 0
    """Size of the entry files read back by hits."""
    writes: int = 0
    tokens_written: int = 0
    bytes_written: int = 0
    evicted: int = 0
    deleted_bad: int = 0
    """Files deleted because they were corrupt, truncated, or made by another model or version."""
    skipped_too_large: int = 0
    skipped_no_space: int = 0
    """Saves skipped because evicting every other entry would not leave the minimum free space."""
    write_errors: int = 0


class PayloadSource(Protocol):
    def save_payload(self) -> bytes: ...


# --- pure encoding and decoding ---------------------------------------------------------

def _pad(text: str, size: int, what: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > size:
        raise ValueError(f"{what} {text!r} is longer than {size} bytes")
    return raw.ljust(size, b"\0")


def _unpad(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def payload_tokens(payload: bytes) -> list[int]:
    """Token ids inside an engine session payload (format version 1 or 2)."""
    if len(payload) < _PAYLOAD_HEAD.size:
        raise EntryError("payload is truncated")
    magic, version, _code, _nl, _nkv, _hd, n = _PAYLOAD_HEAD.unpack_from(payload)
    if magic != _PAYLOAD_MAGIC or version not in _PAYLOAD_VERSIONS:
        raise EntryError("payload is not an engine session payload of version 1 or 2")
    if len(payload) < _PAYLOAD_HEAD.size + 4 * n:
        raise EntryError("payload is shorter than its token list")
    return list(struct.unpack_from(f"<{n}i", payload, _PAYLOAD_HEAD.size))


def encode_entry(identity: ModelIdentity, reason: str, prefix_text: str, payload: bytes,
                 trailer: bytes, n_tokens: int, created: float, hits: int = 0,
                 last_used: float | None = None) -> bytes:
    text = prefix_text.encode("utf-8")
    fixed = _FIXED.pack(MAGIC, VERSION, REASON_CODES[reason], 0, HEADER_SIZE,
                        _pad(identity.model_id, 64, "model id"), _pad(identity.quant, 16, "quantization"),
                        identity.n_ctx, n_tokens, len(text), 0, len(payload), len(trailer), created)
    mutable = _MUTABLE.pack(hits, 0, created if last_used is None else last_used)
    digest = hashlib.sha256(fixed)
    for part in (text, payload, trailer):
        digest.update(part)
    return b"".join([fixed, mutable, digest.digest(), text, payload, trailer])


@dataclass(frozen=True)
class Header:
    reason: str
    model_id: str
    quant: str
    n_ctx: int
    n_tokens: int
    text_len: int
    payload_len: int
    trailer_len: int
    created: float
    hits: int
    last_used: float
    digest: bytes
    fixed: bytes

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.text_len + self.payload_len + self.trailer_len


def decode_header(raw: bytes) -> Header:
    if len(raw) < HEADER_SIZE:
        raise EntryError("file is shorter than the header")
    (magic, version, reason, _r0, hsize, model_id, quant, n_ctx, n_tokens, text_len, _r1,
     payload_len, trailer_len, created) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise EntryError("not a ds4 KV cache file")
    if version != VERSION or hsize != HEADER_SIZE:
        raise EntryError(f"format version {version} (this server reads {VERSION})")
    if reason not in REASON_NAMES:
        raise EntryError(f"unknown save reason code {reason}")
    hits, _r2, last_used = _MUTABLE.unpack_from(raw, _FIXED.size)
    if not (math.isfinite(created) and math.isfinite(last_used)):
        raise EntryError("timestamps are not finite")
    return Header(REASON_NAMES[reason], _unpad(model_id), _unpad(quant), n_ctx, n_tokens, text_len,
                  payload_len, trailer_len, created, hits, last_used,
                  raw[_FIXED.size + _MUTABLE.size: HEADER_SIZE], raw[:_FIXED.size])


def check_compatible(header: Header, identity: ModelIdentity) -> None:
    if header.model_id != identity.model_id:
        raise EntryError(f"made by model {header.model_id!r}, not {identity.model_id!r}")
    if header.quant != identity.quant:
        raise EntryError(f"quantization {header.quant}, not {identity.quant}")
    if header.n_ctx != identity.n_ctx:
        raise EntryError(f"context size {header.n_ctx}, not {identity.n_ctx}")


def decode_entry(key: str, raw: bytes, identity: ModelIdentity) -> tuple[Header, str, bytes, bytes, list[int]]:
    """Verify a whole file; (header, text, payload, trailer, tokens) or EntryError."""
    header = decode_header(raw)
    check_compatible(header, identity)
    if len(raw) != header.file_size:
        raise EntryError(f"size {len(raw)} bytes, header says {header.file_size}")
    body = memoryview(raw)[HEADER_SIZE:]
    digest = hashlib.sha256(header.fixed)
    digest.update(body)
    if digest.digest() != header.digest:
        raise EntryError("content hash mismatch")
    t_end = header.text_len
    p_end = t_end + header.payload_len
    text_bytes = bytes(body[:t_end])
    if hashlib.sha1(text_bytes).hexdigest() != key:
        raise EntryError("file name is not the SHA-1 of its prefix text")
    try:
        text = text_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise EntryError("prefix text is not UTF-8") from None
    payload = bytes(body[t_end:p_end])
    tokens = payload_tokens(payload)
    if len(tokens) != header.n_tokens:
        raise EntryError(f"payload holds {len(tokens)} tokens, header says {header.n_tokens}")
    return header, text, payload, bytes(body[p_end:]), tokens


def text_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view[:_WRITE_CHUNK])
        view = view[n:]


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor for `path` only if it is a regular file (not a link, FIFO, socket or device).

    O_NONBLOCK keeps the open itself from waiting for a FIFO's writer; the fstat after it
    decides. Raises OSError (NotRegularFile for the wrong kind of file)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is not a regular file (mode {stat.filemode(mode)})")
        # Later reads and writes should block normally (it is a regular file).
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class NotRegularFile(OSError):
    """A directory entry that is not a regular file."""


def _read_regular(path: str, limit: int | None = None) -> tuple[bytes, int]:
    """(the first `limit` bytes, or all, of a regular file; its size)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return (f.read() if limit is None else f.read(limit)), size


def _create_exclusive(path: str) -> int:
    """A new file at `path` (mode 0600) for writing. O_EXCL|O_NOFOLLOW: a link planted under
    the name is never written through; whatever holds the name is unlinked (only the name:
    a link's target is untouched) and the create tried once more. O_NONBLOCK: never waits."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        log.warning("kv cache: %s already exists: unlinking it, not writing through it", os.path.basename(path))
        os.unlink(path)
        return os.open(path, flags, 0o600)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _amount(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def disk_free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still write on the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class DirectoryInUse(OSError):
    """Another process holds the lock of a cache directory."""


class _DirectoryLocks:
    """The cache directories this process holds, each one `flock` shared by its stores."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[tuple[int, int], list[int]] = {}  # (st_dev, st_ino) -> [fd, users]

    def acquire(self, directory: str) -> tuple[int, int]:
        st = os.stat(directory)
        key = (st.st_dev, st.st_ino)
        with self._mutex:
            held = self._held.get(key)
            if held is not None:
                held[1] += 1
                return key
            fd = _open_lock_file(os.path.join(directory, LOCK_NAME))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                raise DirectoryInUse(f"another process (pid {owner or 'unknown'}) uses this cache directory "
                                     f"(it holds {LOCK_NAME}); one server per directory") from None
            except BaseException:
                os.close(fd)
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
            self._held[key] = [fd, 1]
            return key

    def release(self, key: tuple[int, int]) -> None:
        with self._mutex:
            held = self._held.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                del self._held[key]
                os.close(held[0])  # closing the last descriptor drops the flock


def _open_lock_file(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is not a regular file (mode {stat.filemode(mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd


_LOCKS = _DirectoryLocks()


class DirectoryClaim:
    """This process's hold on a cache directory (see the module docstring); `release()` once."""

    def __init__(self, directory: str | os.PathLike):
        self._release = weakref.finalize(self, _LOCKS.release, _LOCKS.acquire(os.fspath(directory)))

    def release(self) -> None:
        self._release()


def claim_directory(directory: str | os.PathLike) -> DirectoryClaim:
    """Hold `directory` for this process; DirectoryInUse when another process holds it."""
    return DirectoryClaim(directory)


# --- the store ----------------------------------------------------------------------------

class KVStore:
    """An index over one directory of checkpoints of one model. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, identity: ModelIdentity,
                 budget_bytes: int = DEFAULT_BUDGET_MB * MIB, *, clock: Callable[[], float] = time.time,
                 save_policy: policy.SavePolicy = policy.DEFAULT_POLICY,
                 min_free_bytes: int = DEFAULT_MIN_FREE_MB * MIB,
                 free_bytes: Callable[[str], int] = disk_free_bytes):
        """`min_free_bytes`: what a save must leave free on the filesystem; `free_bytes(directory)`
        measures it (tests pass a fake filesystem)."""
        self.directory = os.fspath(directory)
        self.save_policy = save_policy
        self.identity = identity
        self.budget_bytes = int(budget_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.clock = clock
        self._free_bytes = free_bytes
        self._lock = threading.RLock()
        self._index: dict[str, Entry] = {}
        self._restored: str | None = None  # the entry the live session came from: not evicted
        self._stats = KVStoreStats(budget_bytes=self.budget_bytes)
        self._make_directory()
        self._claim = claim_directory(self.directory)
        try:
            self._scan()
        except BaseException:
            self._claim.release()
            raise

    def close(self) -> None:
        """Let go of the directory (other processes may then open it); the index is kept."""
        self._claim.release()

    def _make_directory(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        try:
            mode = os.stat(self.directory).st_mode
        except OSError:
            return
        if mode & 0o077:
            log.warning("kv cache: %s has mode %s: other users can read or change the cached KV state "
                        "(the directory's contents are trusted; chmod 700 it)", self.directory,
                        stat.filemode(mode))

    # -- index --

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    def _forget(self, key: str) -> None:
        """Drop an entry from the index and its file from the directory."""
        self._index.pop(key, None)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def _delete(self, key: str, why: str) -> None:
        log.warning("kv cache: deleting %s%s: %s", key, SUFFIX, why)
        self._forget(key)
        self._stats.deleted_bad += 1

    def _remove_stale_temp(self, name: str, path: str) -> None:
        """Delete an interrupted write: its writer is gone, or it is older than TEMP_MAX_AGE_S."""
        pid = name.rsplit(".", 1)[-1]
        try:
            st = os.lstat(path)
        except OSError:
            return
        if not pid.isdigit():
            return
        age = time.time() - st.st_mtime
        alive = _pid_alive(int(pid))
        if alive and age <= TEMP_MAX_AGE_S:
            return  # a write in progress
        why = (f"it is {age:.0f} s old (more than {TEMP_MAX_AGE_S:.0f} s)" if alive
               else f"its writer (pid {pid}) no longer runs")
        try:
            os.unlink(path)
        except OSError as e:
            log.warning("kv cache: cannot delete the stale temporary file %s: %s", name, e)
            return
        log.info("kv cache: deleted the temporary file %s: %s", name, why)

    def _scan(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if ".kv.tmp." in name:
                self._remove_stale_temp(name, path)
                continue
            key = name[: -len(SUFFIX)]
            if not name.endswith(SUFFIX) or len(key) != 40 or any(c not in "0123456789abcdef" for c in key):
                continue
            try:
                raw, size = _read_regular(path, HEADER_SIZE)
                header = decode_header(raw)
                check_compatible(header, self.identity)
                if size != header.file_size:
                    raise EntryError(f"size {size} bytes, header says {header.file_size}")
                self._check_name(key, path, header)
            except EntryError as e:
                self._delete(key, str(e))
                continue
            except NotRegularFile as e:
                log.warning("kv cache: skipping %s: %s", name, e)
                continue
            except OSError as e:
                log.warning("kv cache: cannot read %s: %s", path, e)
                continue
            self._index[key] = Entry(key, header.reason, header.n_tokens, header.text_len, header.file_size,
                                     header.hits, header.created, header.last_used)

    @staticmethod
    def _check_name(key: str, path: str, header: Header) -> None:
        """EntryError unless the file name is the SHA-1 of the entry's text (read from the file)."""
        fd = open_regular(path)
        try:
            text = os.pread(fd, header.text_len, HEADER_SIZE)
        finally:
            os.close(fd)
        if len(text) != header.text_len or hashlib.sha1(text).hexdigest() != key:
            raise EntryError("file name is not the SHA-1 of its prefix text")

    def entries(self) -> list[Entry]:
        with self._lock:
            return sorted(self._index.values(), key=lambda e: (e.text_len, e.key))

    def stats(self) -> KVStoreStats:
        with self._lock:
            s = KVStoreStats(**vars(self._stats))
            s.entries = len(self._index)
            s.bytes = sum(e.file_size for e in self._index.values())
            return s

    # -- lookup --

    def candidates(self, rendered_text: str, longer_than: int = 0) -> list[Entry]:
        """Indexed entries whose text hash matches a prefix of `rendered_text`, longest first."""
        data = rendered_text.encode("utf-8")
        with self._lock:
            by_len: dict[int, list[Entry]] = {}
            for e in self._index.values():
                if e.text_len <= len(data) and e.n_tokens > longer_than:
                    by_len.setdefault(e.text_len, []).append(e)
            found: list[Entry] = []
            h = hashlib.sha1()
            pos = 0
            for n in sorted(by_len):
                h.update(data[pos:n])
                pos = n
                key = h.copy().hexdigest()
                found.extend(e for e in by_len[n] if e.key == key)
        return found[::-1]

    def lookup(self, rendered_text: str, longer_than: int = 0) -> Hit | None:
        """The verified entry with the longest text that prefixes `rendered_text`, or None.

        `longer_than`: ignore entries of at most this many tokens (what the live session
        already reuses). A candidate that fails verification is deleted and the next
        longest is tried.
        """
        with self._lock:
            self._stats.lookups += 1
            for entry in self.candidates(rendered_text, longer_than):
                hit = self._load(entry, rendered_text)
                if hit is not None:
                    self._stats.hits += 1
                    self._stats.tokens_restored += hit.n_tokens
                    self._stats.bytes_restored += entry.file_size
                    self._restored = entry.key
                    return hit
            self._stats.misses += 1
            return None

    def _load(self, entry: Entry, rendered_text: str) -> Hit | None:
        path = self._path(entry.key)
        try:
            raw, _size = _read_regular(path)
        except FileNotFoundError:
            self._index.pop(entry.key, None)
            return None
        except OSError as e:
            log.warning("kv cache: cannot read %s: %s", path, e)
            return None
        try:
            header, text, payload, trailer, tokens = decode_entry(entry.key, raw, self.identity)
        except EntryError as e:
            self._delete(entry.key, str(e))
            return None
        if not rendered_text.startswith(text):
            return None  # a SHA-1 collision: the entry is fine, it just is not this prompt's prefix
        now = self.clock()
        hits = header.hits + 1
        self._touch(entry.key, hits, now)
        self._index[entry.key] = Entry(entry.key, header.reason, header.n_tokens, header.text_len,
                                       header.file_size, hits, header.created, now)
        return Hit(entry.key, text, tuple(tokens), payload, trailer, header.reason, hits)

    def _touch(self, key: str, hits: int, now: float) -> None:
        """Rewrite the mutable header part in place (16 bytes in one write)."""
        try:
            fd = open_regular(self._path(key), os.O_WRONLY)
        except OSError:
            return
        try:
            os.pwrite(fd, _MUTABLE.pack(min(hits, 0xFFFFFFFF), 0, now), _FIXED.size)
        except OSError as e:
            log.warning("kv cache: cannot update %s%s: %s", key, SUFFIX, e)
        finally:
            os.close(fd)

    # -- store --

    def store(self, prefix_text: str, source: bytes | PayloadSource, reason: str,
              replay_trailer: bytes = b"") -> Entry | None:
        """Write a checkpoint keyed by `prefix_text`, then evict to fit the budget.

        `source` is a payload or anything with `save_payload()` (an engine Session holding
        exactly the tokens of `prefix_text`). Returns the new (or already present) entry, or
        None when it is too large for the budget or the write failed.
        """
        if reason not in REASON_CODES:
            raise ValueError(f"unknown save reason {reason!r} (expected one of {', '.join(REASON_CODES)})")
        key = text_key(prefix_text)
        with self._lock:
            existing = self._index.get(key)
            if existing is not None and os.path.exists(self._path(key)):
                return existing
        payload = source if isinstance(source, (bytes, bytearray)) else source.save_payload()
        payload = bytes(payload)
        n_tokens = len(payload_tokens(payload))
        size = HEADER_SIZE + len(prefix_text.encode("utf-8")) + len(payload) + len(replay_trailer)
        with self._lock:
            if not policy.fits_budget(size, self.budget_bytes):
                self._stats.skipped_too_large += 1
                log.info("kv cache: not writing a %d-byte entry: the budget is %d bytes", size, self.budget_bytes)
                return None
            if not self._make_room(size):
                return None
            now = self.clock()
            data = encode_entry(self.identity, reason, prefix_text, payload, bytes(replay_trailer), n_tokens, now)
            try:
                self._write_atomic(self._path(key), data)
            except OSError as e:
                self._stats.write_errors += 1
                log.warning("kv cache: cannot write %s%s: %s", key, SUFFIX, e)
                return None
            entry = Entry(key, reason, n_tokens, len(prefix_text.encode("utf-8")), len(data), 0, now, now)
            self._index[key] = entry
            self._stats.writes += 1
            self._stats.tokens_written += n_tokens
            self._stats.bytes_written += len(data)
            self._evict(protected={key})
            return entry

    def _make_room(self, size: int) -> bool:
        """Evict until the filesystem keeps `min_free_bytes` free after a write of `size` bytes;
        False (and nothing evicted) when even evicting every other entry would not."""
        try:
            free = self._free_bytes(self.directory)
        except OSError as e:
            log.warning("kv cache: cannot read the free space of %s: %s", self.directory, e)
            return True  # the write itself will tell
        need = policy.space_deficit(free, self.min_free_bytes, size)
        victims = policy.victims_for_space((e.stats() for e in self._index.values()), need, self.clock(),
                                           self._protected(set()))
        if victims is None:
            self._stats.skipped_no_space += 1
            log.warning("kv cache: not writing a %d-byte entry: %s has %s free and %s must stay free "
                        "(--kv-min-free-mb), more than evicting the other entries would give back",
                        size, self.directory, _amount(free), _amount(self.min_free_bytes))
            return False
        for key in victims:
            self._forget(key)
            self._stats.evicted += 1
            log.info("kv cache: evicted %s%s to keep %s free", key, SUFFIX, _amount(self.min_free_bytes))
        return True

    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = _create_exclusive(tmp)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(self.directory)

    def _protected(self, keys: set[str]) -> set[str]:
        # The restored entry is what the live session was built from; the save that follows a
        # restore usually extends it, and deleting it then would throw away the shorter
        # prefix that other conversations share.
        return keys | {self._restored} if self._restored is not None else set(keys)

    def _evict(self, protected: set[str]) -> None:
        victims = policy.select_victims((e.stats() for e in self._index.values()), self.budget_bytes,
                                        self.clock(), self._protected(protected))
        for key in victims:
            self._forget(key)
            self._stats.evicted += 1
            log.info("kv cache: evicted %s%s", key, SUFFIX)

    def remove(self, key: str) -> None:
        """Delete one entry (tests, administration)."""
        with self._lock:
            self._forget(key)
            if self._restored == key:
                self._restored = None


# --- construction from the server flags ------------------------------------------------------

def open_store(config: KVStoreConfig, model: Any, *, clock: Callable[[], float] = time.time) -> KVStore | None:
    """The store for `--kv-disk-dir` / `--kv-cache-budget-mb`, or None when no directory is set."""
    if config.directory is None:
        return None
    if config.budget_mb < 1:
        raise ValueError(f"--kv-cache-budget-mb must be at least 1, not {config.budget_mb}")
    return KVStore(config.directory, identity_of(model), config.budget_bytes, clock=clock,
                   min_free_bytes=config.min_free_bytes)
