"""The disk KV cache: file format, verification, lookup, eviction, restart and crash safety.

Most tests use synthetic payloads (no model); the round trips run tiny random GGUF models
(`engine.synthetic`), and one test runs the embedded model.
"""
from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from server import kvstore as kv
from server.kvstore import HEADER_SIZE, KVStore, ModelIdentity
from server.kvstore_policy import COLD, CONTINUED, EVICT, SHUTDOWN
from server.prompting import prompt_ids
from server_support import system_user_chat as chat

REPO = Path(__file__).resolve().parents[2]
IDENT = ModelIdentity("tiny#0123456789abcdef", "Q4_1", 256)
HOUR = 3600.0


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def payload(n_tokens: int, kv_bytes: int = 0, first: int = 1, version: int = 1) -> bytes:
    """A payload in the engine's layout (version 1, or 2 for a cache with a ring) with
    `kv_bytes` of filler for the rest."""
    head = struct.pack("<6sHBxIIII", b"DS4KV\0", version, 0, 1, 1, 1, n_tokens)
    return head + struct.pack(f"<{n_tokens}i", *range(first, first + n_tokens)) + bytes(kv_bytes)


def file_size(text: str, n_tokens: int, kv_bytes: int = 0, trailer: bytes = b"") -> int:
    return HEADER_SIZE + len(text.encode()) + len(payload(n_tokens, kv_bytes)) + len(trailer)


def kv_files(d: Path) -> list[str]:
    """Every name in the directory but the lock file, which stays there for good."""
    return sorted(p.name for p in d.iterdir() if p.name != kv.LOCK_NAME)


# --- format -------------------------------------------------------------------------------

def test_header_layout_byte_by_byte():
    data = kv.encode_entry(IDENT, EVICT, "héllo", payload(3), b"TR", 3, created=1234.5, hits=7, last_used=99.0)
    assert data[0:8] == b"DS4KVDSK"
    assert struct.unpack_from("<HBBI", data, 8) == (1, 3, 0, 184)
    assert data[16:80].rstrip(b"\0") == IDENT.model_id.encode()
    assert data[80:96].rstrip(b"\0") == b"Q4_1"
    assert struct.unpack_from("<IIII", data, 96) == (256, 3, len("héllo".encode()), 0)
    assert struct.unpack_from("<QQd", data, 112) == (len(payload(3)), 2, 1234.5)
    assert struct.unpack_from("<IId", data, 136) == (7, 0, 99.0)
    text_end = 184 + 6
    assert data[152:184] == hashlib.sha256(data[:136] + data[184:]).digest()
    assert data[184:text_end] == "héllo".encode()
    assert data[text_end:text_end + len(payload(3))] == payload(3)
    assert data[-2:] == b"TR" and len(data) == text_end + len(payload(3)) + 2


def test_store_then_lookup_round_trip(store_dir):
    clock = Clock()
    store = KVStore(store_dir, IDENT, 10**6, clock=clock)
    entry = store.store("system prompt", payload(5, 64), COLD, replay_trailer=b"memory")
    assert entry is not None and entry.n_tokens == 5 and entry.reason == COLD
    assert kv_files(store_dir) == [hashlib.sha1(b"system prompt").hexdigest() + ".kv"]
    clock.t += 10
    hit = store.lookup("system prompt and a question")
    assert hit is not None
    assert (hit.prefix_text, hit.tokens, hit.trailer, hit.reason, hit.hits) == (
        "system prompt", (1, 2, 3, 4, 5), b"memory", COLD, 1)
    assert hit.payload == payload(5, 64)
    s = store.stats()
    assert (s.entries, s.lookups, s.hits, s.misses) == (1, 1, 1, 0)
    assert (s.tokens_restored, s.writes, s.tokens_written, s.bytes) == (5, 1, 5, entry.file_size)
    assert store.lookup("another prompt") is None and store.stats().misses == 1


def test_hits_and_last_used_persist_in_the_header(store_dir):
    clock = Clock()
    store = KVStore(store_dir, IDENT, 10**6, clock=clock)
    store.store("abc", payload(2), COLD)
    for i in range(3):
        clock.t += 60
        assert store.lookup("abcd").hits == i + 1
    reopened = KVStore(store_dir, IDENT, 10**6, clock=clock)
    (entry,) = reopened.entries()
    assert (entry.hits, entry.last_used, entry.created) == (3, clock.t, clock.t - 180)
    assert reopened.lookup("abc").hits == 4  # the content hash still holds after in-place updates


def test_storing_the_same_text_twice_keeps_one_file(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    first = store.store("abc", payload(2), COLD)
    assert store.store("abc", payload(2), EVICT) == first
    assert len(kv_files(store_dir)) == 1 and store.stats().writes == 1


def test_unknown_reason_is_refused(store_dir):
    with pytest.raises(ValueError, match="reason"):
        KVStore(store_dir, IDENT).store("abc", payload(1), "whenever")


# --- lookup -------------------------------------------------------------------------------

def test_longest_byte_prefix_wins_among_candidates(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    for text, n in (("abc", 1), ("abcdef", 2), ("abcxyz", 3), ("zzz", 4), ("héllo wörld", 5), ("héllo", 6)):
        store.store(text, payload(n), CONTINUED)
    assert store.lookup("abcdefg").prefix_text == "abcdef"
    assert store.lookup("abcdef").prefix_text == "abcdef"  # an entry may be the whole prompt
    assert store.lookup("abcxy").prefix_text == "abc"
    assert store.lookup("héllo wörld!").prefix_text == "héllo wörld"
    assert store.lookup("héllo w").prefix_text == "héllo"
    assert store.lookup("ab") is None
    assert store.lookup("xabcdef") is None
    # Entries no longer than what the live session already has are not worth reading.
    assert store.lookup("abcdefg", longer_than=1).prefix_text == "abcdef"
    assert store.lookup("abcdefg", longer_than=2) is None
    assert [e.text_len for e in store.candidates("abcdefg")] == [6, 3]


def test_a_bad_longest_candidate_falls_back_to_the_next(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    store.store("abc", payload(1), COLD)
    long = store.store("abcdef", payload(2, 32), COLD)
    path = store_dir / f"{long.key}.kv"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    hit = store.lookup("abcdefgh")
    assert hit.prefix_text == "abc"
    assert not path.exists() and store.stats().deleted_bad == 1


# --- corruption and incompatibility ---------------------------------------------------------

def corrupt(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["text", "payload", "trailer", "fixed_header"])
def test_flipped_bit_is_detected_and_the_file_deleted(store_dir, where):
    store = KVStore(store_dir, IDENT, 10**6)
    e = store.store("prefix text", payload(4, 16), COLD, replay_trailer=b"trailer")
    path = store_dir / f"{e.key}.kv"
    offset = {"text": HEADER_SIZE + 2, "payload": HEADER_SIZE + 11 + 30, "trailer": path.stat().st_size - 1,
              "fixed_header": 128}[where]  # 128: the creation time, hashed but not checked otherwise
    corrupt(path, offset)
    reopened = KVStore(store_dir, IDENT, 10**6)
    assert reopened.lookup("prefix text, then more") is None
    assert not path.exists() and reopened.stats().deleted_bad == 1


def test_truncated_file_is_deleted_when_the_store_opens(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    e = store.store("prefix", payload(4, 100), COLD)
    path = store_dir / f"{e.key}.kv"
    path.write_bytes(path.read_bytes()[:-10])
    reopened = KVStore(store_dir, IDENT, 10**6)
    assert reopened.entries() == [] and not path.exists()
    (store_dir / ("0" * 40 + ".kv")).write_bytes(b"DS4")  # shorter than a header
    assert KVStore(store_dir, IDENT).entries() == [] and kv_files(store_dir) == []


def test_other_version_is_deleted(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    e = store.store("prefix", payload(2), COLD)
    path = store_dir / f"{e.key}.kv"
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 8, 2)
    path.write_bytes(bytes(raw))
    reopened = KVStore(store_dir, IDENT, 10**6)
    assert reopened.lookup("prefix!") is None and not path.exists()


@pytest.mark.parametrize("other", [
    ModelIdentity("other#0123456789abcdef", "Q4_1", 256),
    ModelIdentity(IDENT.model_id, "Q8_0", 256),
    ModelIdentity(IDENT.model_id, "Q4_1", 512),
])
def test_entries_of_another_model_are_deleted(store_dir, other):
    KVStore(store_dir, IDENT, 10**6).store("prefix", payload(2), COLD)
    store = KVStore(store_dir, other, 10**6)
    assert store.entries() == [] and kv_files(store_dir) == []
    assert store.stats().deleted_bad == 1


def test_a_file_under_the_wrong_name_is_never_used(store_dir):
    store = KVStore(store_dir, IDENT, 10**6)
    e = store.store("abc", payload(2), COLD)
    wrong = hashlib.sha1(b"xyz").hexdigest()
    os.replace(store_dir / f"{e.key}.kv", store_dir / f"{wrong}.kv")
    reopened = KVStore(store_dir, IDENT, 10**6)
    assert reopened.lookup("xyz and more") is None
    assert kv_files(store_dir) == []


def test_payload_token_count_must_match_the_header(store_dir):
    data = bytearray(kv.encode_entry(IDENT, COLD, "abc", payload(3), b"", 3, created=1.0))
    struct.pack_into("<I", data, 100, 4)  # header claims 4 tokens, and re-hash so only the count is wrong
    data[152:184] = hashlib.sha256(bytes(data[:136]) + bytes(data[184:])).digest()
    store_dir.mkdir()
    (store_dir / (hashlib.sha1(b"abc").hexdigest() + ".kv")).write_bytes(bytes(data))
    store = KVStore(store_dir, IDENT)
    assert store.lookup("abcd") is None and kv_files(store_dir) == []


def test_token_ids_are_read_from_both_payload_versions_and_no_other():
    assert kv.payload_tokens(payload(3, 16, first=5)) == [5, 6, 7]
    assert kv.payload_tokens(payload(3, 16, first=5, version=2)) == [5, 6, 7]
    with pytest.raises(kv.EntryError, match="version 1 or 2"):
        kv.payload_tokens(payload(3, 16, version=3))


def test_unrelated_files_are_left_alone(store_dir):
    store_dir.mkdir()
    (store_dir / "README").write_text("mine")
    (store_dir / "notes.kv").write_text("not a cache key")
    KVStore(store_dir, IDENT)
    assert kv_files(store_dir) == ["README", "notes.kv"]


# --- eviction -----------------------------------------------------------------------------

def store_at(store: KVStore, clock: Clock, t: float, text: str, n: int, reason: str = CONTINUED,
             kv_bytes: int = 900) -> kv.Entry:
    clock.t = t
    entry = store.store(text, payload(n, kv_bytes), reason)
    assert entry is not None
    return entry


def keys_left(store: KVStore) -> set[str]:
    return {e.key for e in store.entries()}


def test_tight_budget_evicts_least_recently_used_among_equals(store_dir):
    clock = Clock()
    one = file_size("aa", 10, 900)
    store = KVStore(store_dir, IDENT, 2 * one + 10, clock=clock)
    a = store_at(store, clock, 0, "aa", 10)
    b = store_at(store, clock, 10, "bb", 10)
    c = store_at(store, clock, 20, "cc", 10)
    assert keys_left(store) == {b.key, c.key}
    assert store.stats().evicted == 1 and store.stats().bytes <= store.budget_bytes
    assert not (store_dir / f"{a.key}.kv").exists()


@pytest.mark.parametrize("later, evicted", [(3.0, "cld"), (24 * HOUR, "fav")])
def test_decayed_hits_decide_the_victim(tmp_path, later, evicted):
    clock = Clock()
    one = file_size("aa", 10, 900)
    store = KVStore(tmp_path / "kv", IDENT, 3 * one + 10, clock=clock)
    store_at(store, clock, 0, "fav", 10)
    for _ in range(4):
        assert store.lookup("fav!") is not None  # 4 hits at t=0
    store_at(store, clock, 1, "cld", 10, COLD)
    store_at(store, clock, 2, "new", 10)
    assert store.lookup("new!") is not None  # "new" is now the restored entry: protected
    assert store.lookup("nothing") is None  # a miss does not change that
    store_at(store, clock, later, "xtr", 10)  # over budget: fav or cld must go
    # Soon after: fav scores (4 + 1) against the cold anchor's 2 * (0 + 1), so the anchor goes.
    # Four half-lives later fav's hits count 0.25: 1.25 against 2, so fav goes.
    left = {e.key for e in store.entries()}
    gone = {hashlib.sha1(t.encode()).hexdigest(): t for t in ("fav", "cld", "new", "xtr")}
    assert [t for k, t in gone.items() if k not in left] == [evicted]


def test_anchor_bonus_outweighs_recency(store_dir):
    clock = Clock()
    one = file_size("aa", 10, 900)
    store = KVStore(store_dir, IDENT, 2 * one + 10, clock=clock)
    cold = store_at(store, clock, 0, "c1", 10, COLD)
    cont = store_at(store, clock, 100, "c2", 10, CONTINUED)
    shut = store_at(store, clock, 200, "s3", 10, SHUTDOWN)
    assert keys_left(store) == {cold.key, shut.key}
    assert cont.key not in keys_left(store)


def test_just_written_entry_is_protected_even_when_it_scores_lowest(store_dir):
    clock = Clock()
    store = KVStore(store_dir, IDENT, 2 * file_size("aa", 10, 900) + 10, clock=clock)
    a = store_at(store, clock, 0, "aa", 10, COLD)
    b = store_at(store, clock, 1, "bb", 10, COLD)
    poor = store_at(store, clock, 2, "pp", 2, CONTINUED, kv_bytes=900)  # fewest tokens per byte
    assert poor.key in keys_left(store) and a.key not in keys_left(store) and b.key in keys_left(store)


def test_just_restored_entry_survives_the_next_save(store_dir):
    clock = Clock()
    store = KVStore(store_dir, IDENT, 2 * file_size("aa", 10, 900) + 10, clock=clock)
    low = store_at(store, clock, 0, "lo", 5, CONTINUED)  # the lowest score of all
    high = store_at(store, clock, 1, "hi", 10, COLD)
    assert store.lookup("lo and the rest").prefix_text == "lo"
    new = store_at(store, clock, 2, "lo and", 10, COLD)  # the cold save that follows the restore
    assert keys_left(store) == {low.key, new.key}
    assert high.key not in keys_left(store)


def test_entry_larger_than_the_budget_is_not_written(store_dir):
    size = file_size("big", 10, 900)
    store = KVStore(store_dir, IDENT, int(size / 0.99) - 1)
    assert store.store("big", payload(10, 900), COLD) is None
    assert kv_files(store_dir) == [] and store.stats().skipped_too_large == 1
    roomy = KVStore(store_dir, IDENT, int(size / 0.99) + 1)
    assert roomy.store("big", payload(10, 900), COLD) is not None


def key_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class SmallFilesystem:
    """A filesystem of `capacity` bytes holding the directory's files and `other` bytes of
    someone else's: what `os.statvfs` would report free, for `KVStore(free_bytes=...)`."""

    def __init__(self, capacity: int, other: int = 0):
        self.capacity, self.other = capacity, other

    def __call__(self, directory: str) -> int:
        used = sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())
        return self.capacity - self.other - used


def test_saves_on_a_nearly_full_filesystem_evict_the_oldest_to_keep_the_minimum_free(store_dir, caplog):
    clock = Clock()
    size = file_size("text 00", 10, 10_000)
    fs = SmallFilesystem(capacity=6 * size + 100)  # and the few bytes of the lock file
    store = KVStore(store_dir, IDENT, 10**9, clock=clock, min_free_bytes=2 * size, free_bytes=fs)
    with caplog.at_level("INFO", logger="ds4.server.kvstore"):
        for i in range(12):  # far more than fit: every save succeeds, the oldest entries go
            clock.t += 60
            assert store.store(f"text {i:02d}", payload(10, 10_000), CONTINUED) is not None, i
            assert fs(str(store_dir)) >= 2 * size
    assert sorted(e.key for e in store.entries()) == sorted(key_of(f"text {i:02d}") for i in (8, 9, 10, 11))
    s = store.stats()
    assert s.writes == 12 and s.evicted == 8 and s.write_errors == 0 and s.skipped_no_space == 0
    assert sum("evicted" in r.message and "to keep" in r.message for r in caplog.records) == 8


def test_a_save_that_cannot_leave_the_minimum_free_is_skipped_with_one_line_and_nothing_evicted(store_dir, caplog):
    clock = Clock()
    size = file_size("text 00", 10, 10_000)
    fs = SmallFilesystem(capacity=10 * size + 100, other=7 * size)  # someone else filled the disk
    store = KVStore(store_dir, IDENT, 10**9, clock=clock, min_free_bytes=size, free_bytes=fs)
    assert store.store("text 00", payload(10, 10_000), CONTINUED) is not None
    with caplog.at_level("WARNING", logger="ds4.server.kvstore"):
        for i in (1, 2):  # the third save evicts the first to keep `size` free
            assert store.store(f"text {i:02d}", payload(10, 10_000), CONTINUED) is not None
        assert len(store.entries()) == 2
        # The other files grow: even with all of ours gone, a larger entry would not leave
        # the minimum free.
        fs.other = 9 * size
        assert store.store("text 99", payload(10, 50_000), CONTINUED) is None
    assert len(store.entries()) == 2  # nothing evicted in vain
    lines = [r.message for r in caplog.records if "not writing" in r.message]
    assert len(lines) == 1 and "must stay free (--kv-min-free-mb)" in lines[0]
    assert store.stats().skipped_no_space == 1
    # Once the other files go, saves work again: the cache never stays stuck.
    fs.other = 0
    assert store.store("text 99", payload(10, 50_000), CONTINUED) is not None


def test_the_real_free_space_is_read_from_statvfs(store_dir):
    store_dir.mkdir()
    st = os.statvfs(store_dir)
    assert abs(kv.disk_free_bytes(str(store_dir)) - st.f_bavail * st.f_frsize) < 64 * kv.MIB
    # A minimum larger than any disk: the save is skipped, not failed.
    store = KVStore(store_dir, IDENT, 10**9, min_free_bytes=1 << 62)
    assert store.store("a", payload(3), COLD) is None and store.stats().skipped_no_space == 1


def test_eviction_state_survives_a_restart(store_dir):
    clock = Clock()
    one = file_size("aa", 10, 900)
    store = KVStore(store_dir, IDENT, 3 * one, clock=clock)
    a = store_at(store, clock, 0, "aa", 10)
    b = store_at(store, clock, 10, "bb", 10)
    clock.t = 20
    store.lookup("aa!")  # "aa" was used last, so "bb" is now the least recently used
    reopened = KVStore(store_dir, IDENT, 2 * one + 10, clock=clock)
    store_at(reopened, clock, 30, "cc", 10)
    assert a.key in keys_left(reopened) and b.key not in keys_left(reopened)


# --- crash safety ---------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, struct, sys, time
    from server import kvstore as kv

    def slow_write(fd, data):
        view = memoryview(data)
        while view:
            n = os.write(fd, view[:4096])
            view = view[n:]
            time.sleep(0.002)
            print("wrote", flush=True)

    kv._write_all = slow_write
    ident = kv.ModelIdentity("tiny#0123456789abcdef", "Q4_1", 256)
    store = kv.KVStore(sys.argv[1], ident, 10**9)
    n = 1000
    head = struct.pack("<6sHBxIIII", b"DS4KV\\0", 1, 0, 1, 1, 1, n)
    payload = head + struct.pack(f"<{n}i", *range(n)) + bytes(2_000_000)
    store.store("a long shared prefix", payload, "cold")
    print("done", flush=True)
""")


def test_killing_a_writer_mid_write_leaves_nothing_that_loads(store_dir):
    good = KVStore(store_dir, IDENT, 10**9).store("a long", payload(3, 16), COLD)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store_dir)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(20):  # wait until the temporary file is being filled
            line = proc.stdout.readline()
            assert line.startswith("wrote"), line + proc.stderr.read()
        tmp = [p for p in store_dir.iterdir() if ".tmp." in p.name]
        assert len(tmp) == 1 and 0 < tmp[0].stat().st_size
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    new_key = hashlib.sha1(b"a long shared prefix").hexdigest()
    assert not (store_dir / f"{new_key}.kv").exists()
    store = KVStore(store_dir, IDENT, 10**9)
    assert kv_files(store_dir) == [f"{good.key}.kv"]  # the dead writer's temp file is gone
    hit = store.lookup("a long shared prefix, then the question")
    assert hit.prefix_text == "a long" and hit.payload == payload(3, 16)


def test_temp_file_of_a_live_writer_is_left_alone(store_dir):
    store_dir.mkdir()
    mine = store_dir / f"{'1' * 40}.kv.tmp.{os.getpid()}"
    mine.write_bytes(b"partial")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = store_dir / f"{'2' * 40}.kv.tmp.{int(done.stdout)}"
    dead.write_bytes(b"partial")
    KVStore(store_dir, IDENT)
    assert mine.exists() and not dead.exists()


# --- with a real (tiny) model ------------------------------------------------------------------


def test_restored_session_matches_a_cold_prefill(tiny_model, store_dir):
    m = tiny_model
    text = chat(m, "the theme of the day is the weather " * 3, "then what?")
    ids = prompt_ids(m, text)
    n, prefix = kv.policy.prefix_text_at(text, ids, 80, detokenize=m.detokenize,
                                         prompt_ids=lambda t: prompt_ids(m, t),
                                         tokenize_suffix=lambda s: m.tokenize(s, special=True))
    warm_src = m.new_session()
    warm_src.sync(ids[:n])
    store = KVStore(store_dir, kv.identity_of(m), 10**7)
    assert store.store(prefix, warm_src, COLD).n_tokens == n

    restarted = KVStore(store_dir, kv.identity_of(m), 10**7)
    hit = restarted.lookup(text)
    assert hit.prefix_text == prefix and list(hit.tokens) == ids[:n]
    warm = m.new_session()
    warm.load_payload(hit.payload)
    suffix = m.tokenize(text[len(hit.prefix_text):], special=True)
    assert list(hit.tokens) + suffix == ids
    assert warm.sync(list(hit.tokens) + suffix) == n
    cold = m.new_session()
    cold.sync(ids)
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=1e-4)
    assert int(warm.logits.argmax()) == int(cold.logits.argmax())
    # The payload itself round-trips bit for bit.
    again = m.new_session()
    again.load_payload(hit.payload)
    assert again.save_payload() == hit.payload


def test_a_ring_models_checkpoint_holds_only_the_window_of_its_ring_layers(store_dir, tmp_path):
    """Gemma 3 (five sliding-window layers of six, window 4): an entry past the window takes the
    ring layers' last 4 positions only, the budget counts those bytes, and the restored session
    decodes bit for bit as the one that was saved."""
    from engine import load_model
    from gemma_models import GemmaSpec, write_random_gemma

    m = load_model(write_random_gemma(tmp_path / "gemma3.gguf", GemmaSpec(arch="gemma3", qtype="Q8_0", seed=4)))
    cfg, ring = m.config, m.new_session().cache.layout.ring
    assert (ring.window, len(ring.layers)) == (4, 5)
    ids, more = list(range(10, 50)), [7, 8, 9, 11]
    src = m.new_session()
    src.sync(ids)
    store = KVStore(store_dir, kv.identity_of(m), 10**7)
    entry = store.store("gemma prefix", src, COLD)
    layer = 2 * cfg.n_head_kv * cfg.head_dim * 2  # K and V of one layer at one position, float16
    rows = (len(ids) * 1 + 4 * 5) * layer  # one global layer at every position, five at the window's
    payload_size = 26 + 4 * len(ids) + 8 + 4 * 5 + rows  # header, tokens, the ring's window and layers
    assert entry.file_size == HEADER_SIZE + len("gemma prefix") + payload_size
    assert store.stats().bytes == entry.file_size
    assert 4 * rows == len(ids) * cfg.n_layer * layer  # the full form held every layer at every position

    hit = KVStore(store_dir, kv.identity_of(m), 10**7).lookup("gemma prefix and what follows")
    assert list(hit.tokens) == ids and len(hit.payload) == payload_size
    warm = m.new_session()
    warm.load_payload(hit.payload)
    assert torch.equal(warm.logits, src.logits)
    for t in more:
        warm.eval(t)
        src.eval(t)
        assert torch.equal(warm.logits, src.logits)


def test_identity_changes_with_the_weights(tmp_path, tiny_model):
    from engine.synthetic import RandomModelSpec, write_random_gguf

    other = write_random_gguf(tmp_path / "other.gguf", RandomModelSpec(n_ctx=256, seed=8))
    assert kv.model_fingerprint(other, "random") != kv.model_fingerprint(tiny_model.path, "random")
    ident = kv.identity_of(tiny_model)
    assert ident.quant == "Q4_1" and ident.n_ctx == 256 and ident.model_id.startswith("random#")


def test_open_store_from_the_server_flags(tiny_model, tmp_path):
    assert kv.open_store(kv.KVStoreConfig(), tiny_model) is None
    store = kv.open_store(kv.KVStoreConfig(directory=str(tmp_path / "kv"), budget_mb=2), tiny_model)
    assert store.budget_bytes == 2 * 1024 * 1024 and store.identity == kv.identity_of(tiny_model)
    with pytest.raises(ValueError, match="budget"):
        kv.open_store(kv.KVStoreConfig(directory=str(tmp_path), budget_mb=0), tiny_model)
