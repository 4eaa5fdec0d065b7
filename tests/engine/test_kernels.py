"""The compiled CPU kernels of every path this CPU runs (engine.kernels): decode attention and
the int4, int8 and float16 matmuls against float64 references, their row invariance, how the
paths relate, the choice of path and the build."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kernels
from engine.weights import Int4Linear, int4_pack, exact_scale_dtype

COMPILED = [p for p in kernels.host_paths() if p != "torch"]


def path_kernels(name: str) -> kernels.CpuKernels:
    why = kernels.unavailable_reason(name)
    if why is not None and name == "amx" and "operating system" in why:
        pytest.skip(why)
    # The project's setup provides a compiler and ninja: a path the CPU runs must build, or its
    # code would go untested here.
    assert why is None, why
    return kernels.cpu_kernels(name)


@pytest.fixture(scope="module", params=COMPILED)
def path(request) -> kernels.CpuKernels:
    return path_kernels(request.param)


# ---------------------------------------------------------------- choosing a path


def test_paths_need_their_instructions():
    avx2 = frozenset({"avx2", "fma", "f16c"})
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert kernels.missing_features("avx2", avx2, x86=True) == []
    assert kernels.missing_features("avx2", frozenset({"avx2", "fma"}), x86=True) == ["f16c"]
    assert kernels.missing_features("avx512", avx2, x86=True) == sorted(avx512 - avx2)
    assert kernels.missing_features("amx", avx512, x86=True) == ["amx_bf16", "amx_tile"]
    assert kernels.missing_features("avx2", avx2, x86=False)[0].startswith("an x86-64 CPU")
    for anywhere in ("portable", "torch"):
        assert kernels.missing_features(anywhere, frozenset(), x86=False) == []
    with pytest.raises(ValueError, match="unknown CPU kernel path 'sse9'"):
        kernels.missing_features("sse9")


def test_host_paths_are_ordered_best_first_and_end_with_the_fallbacks():
    paths = kernels.host_paths()
    assert paths == [p for p in kernels.PATHS if p in paths]
    assert paths[-2:] == ["portable", "torch"]


def test_the_default_is_the_best_path_that_builds(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    chosen = kernels.cpu_kernels()
    best = next(p for p in kernels.host_paths() if kernels.unavailable_reason(p) is None)
    assert chosen.name == best
    assert chosen.describe().startswith(best + " (")


def test_the_override_names_a_path(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "avx2" if "avx2" in COMPILED else "portable")
    chosen = kernels.cpu_kernels()
    assert chosen.name in ("avx2", "portable") and kernels.ENV_VAR in chosen.reason


def test_a_path_this_cpu_cannot_run_is_an_error_naming_what_it_lacks(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2"}))
    monkeypatch.setattr(kernels, "_chosen", {})
    with pytest.raises(kernels.KernelsUnavailable, match=r"'avx2' need avx2, f16c, fma.*it runs: portable, torch"):
        kernels.cpu_kernels("avx2")
    with pytest.raises(kernels.KernelsUnavailable, match="unknown CPU kernel path 'fast'"):
        kernels.cpu_kernels("fast")


def test_load_model_turns_a_bad_override_into_a_one_line_load_error(tiny_gguf, monkeypatch):
    import engine

    monkeypatch.setenv(kernels.ENV_VAR, "nosuch")
    with pytest.raises(engine.ModelLoadError, match="unknown CPU kernel path 'nosuch'"):
        engine.load_model(tiny_gguf("llama", "Q4_1"))


def test_torch_path_has_no_compiled_ops():
    t = kernels.cpu_kernels("torch")
    assert (t.attention, t.int4, t.int4_add, t.int4_tiles, t.int8, t.f16, t.rms_norm, t.swiglu) == (None,) * 8


# ---------------------------------------------------------------- decode attention


def reference(qkv: torch.Tensor, kv: torch.Tensor, pos: int, H: int, Hkv: int, D: int) -> torch.Tensor:
    """One row: store its K and V at pos in a copy of kv (rounded to kv's dtype), attend
    [0, pos] in float64."""
    stored = qkv.to(kv.dtype).double()
    kv = kv.double().clone()
    kv[0, :, pos] = stored[H * D:(H + Hkv) * D].view(Hkv, D)
    kv[1, :, pos] = stored[(H + Hkv) * D:].view(Hkv, D)
    q = qkv.double()[: H * D].view(Hkv, H // Hkv, D) * D ** -0.5
    keys, vals = kv[0, :, : pos + 1], kv[1, :, : pos + 1]
    return torch.softmax(q @ keys.transpose(1, 2), dim=-1).matmul(vals).reshape(H * D)


def make(n: int, H: int, Hkv: int, D: int, cap: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    # Rows of a wider tensor, and caches as slots of one pool: the kernel takes strided views.
    qkv = torch.randn(n, (H + 2 * Hkv) * D + 5, generator=g)[:, : (H + 2 * Hkv) * D]
    pool = (torch.randn(2, n, Hkv, cap, D, generator=g) * 2).to(dtype)
    return qkv, pool, [pool[:, i] for i in range(n)]


@pytest.fixture(scope="module")
def attention(path):
    assert path.attention is not None
    return path.attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (9, 3, 64), (8, 8, 32), (8, 2, 128), (6, 1, 48)])
def test_attention_matches_float64_reference_and_stores_kv(attention, H, Hkv, D, dtype):
    positions = [0, 14, 15, 16, 47, 300, 600]  # the last one in two spans of keys
    qkv, pool, caches = make(len(positions), H, Hkv, D, cap=640, dtype=dtype)
    before = pool.clone()
    out = attention(qkv, caches, positions, D ** -0.5)
    assert out.shape == (len(positions), H * D) and out.dtype == torch.float32
    for i, p in enumerate(positions):
        want = reference(qkv[i], before[:, i], p, H, Hkv, D)
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=2e-6)
        assert torch.equal(pool[0, i, :, p], qkv[i, H * D:(H + Hkv) * D].view(Hkv, D).to(dtype))
        assert torch.equal(pool[1, i, :, p], qkv[i, (H + Hkv) * D:].view(Hkv, D).to(dtype))
        # Positions other than p are untouched.
        mask = torch.ones(pool.shape[3], dtype=torch.bool)
        mask[p] = False
        assert torch.equal(pool[:, i, :, mask], before[:, i, :, mask])


def test_attention_large_scores_do_not_overflow(attention):
    H, Hkv, D = 2, 1, 16
    qkv, pool, caches = make(1, H, Hkv, D, cap=64)
    qkv *= 300  # scores of several thousand: exp must be taken after the max shift
    before = pool.clone()
    out = attention(qkv, caches, [40], D ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0].double(), reference(qkv[0], before[:, 0], 40, H, Hkv, D), rtol=1e-4, atol=1e-4)


def with_threads(check):
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, max(2, threads)):
            torch.set_num_threads(n_threads)
            check(n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_row_is_bitwise_independent_of_its_batch_and_thread_count(attention, dtype):
    H, Hkv, D = 9, 3, 64
    positions = [3, 130, 17, 511, 64, 512, 1100]  # one span of 512 keys, just past it, three spans
    qkv, pool, caches = make(len(positions), H, Hkv, D, cap=1152, seed=1, dtype=dtype)
    start = pool.clone()
    together = attention(qkv, caches, positions, D ** -0.5)

    def check(n_threads):
        for i, p in enumerate(positions):
            pool.copy_(start)
            alone = attention(qkv[i:i + 1], [caches[i]], [p], D ** -0.5)
            assert torch.equal(alone[0], together[i]), (n_threads, i)
    with_threads(check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_gives_each_row_the_bits_of_decoding_it(path, dtype):
    """A prefill chunk [start, start + T) attends like T decoding steps, row by row, bit for bit:
    here across the first span boundary (512 keys) and into a third span."""
    H, Hkv, D, start, T = 9, 3, 64, 500, 600
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    kv = (torch.randn(2, Hkv, 1152, D, generator=g) * 2).to(dtype)
    kv[0, :, start:start + T] = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D).transpose(0, 1).to(dtype)
    kv[1, :, start:start + T] = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).transpose(0, 1).to(dtype)
    chunk = path.prefill_attention(qkv[:, : H * D], kv, start, D ** -0.5)
    for i in (0, 11, 12, 13, 300, T - 1):  # positions 500 .. 1099
        step = path.attention(qkv[i:i + 1], [kv.clone()], [start + i], D ** -0.5)
        assert torch.equal(step[0], chunk[i]), i


def test_attention_bad_arguments_are_errors_with_messages(attention):
    qkv, pool, caches = make(2, 4, 2, 16, cap=32)
    with pytest.raises(RuntimeError, match="one cache and one position per row"):
        attention(qkv, caches[:1], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="outside cache 1"):
        attention(qkv, caches, [1, 32], 0.25)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        attention(qkv, [c.double() for c in caches], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="like cache 0"):
        attention(qkv, [caches[0], caches[1].half()], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="width"):
        attention(qkv[:, :-16], caches, [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attention(torch.randn(1, 4 * 12), [torch.zeros(2, 1, 8, 12)], [0], 0.25)


# ---------------------------------------------------------------- windows, ring caches, soft-capping


def first_key(p: int, window: int) -> int:
    return max(0, p + 1 - window) if window else 0


def reference_window(qkv: torch.Tensor, kv: torch.Tensor, pos: int, H: int, Hkv: int, D: int, window: int,
                     softcap: float) -> torch.Tensor:
    """One row in float64: store its K and V at slot pos % capacity of a copy of kv (rounded to
    kv's dtype), attend positions [first_key, pos] from their slots, scores capped."""
    cap = kv.shape[2]
    stored = qkv.to(kv.dtype).double()
    kv = kv.double().clone()
    kv[0, :, pos % cap] = stored[H * D:(H + Hkv) * D].view(Hkv, D)
    kv[1, :, pos % cap] = stored[(H + Hkv) * D:].view(Hkv, D)
    slots = torch.tensor([p % cap for p in range(first_key(pos, window), pos + 1)])
    q = qkv.double()[: H * D].view(Hkv, H // Hkv, D) * D ** -0.5
    scores = q @ kv[0][:, slots].transpose(1, 2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores, dim=-1).matmul(kv[1][:, slots]).reshape(H * D)


# (window, softcap, [(position, capacity), ...]): rings that wrap and caches that do not, spans
# of one key, of a full ring, and past 512 keys (split into spans).
WINDOW_CASES = [
    (0, 0.0, [(0, 8), (50, 128), (600, 700)]),
    (0, 5.0, [(0, 8), (50, 128), (600, 700)]),
    (100, 0.0, [(50, 100), (99, 100), (250, 100), (1000, 128), (345, 160)]),
    (700, 5.0, [(50, 900), (699, 700), (2000, 800), (1500, 701)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 1, 64), (3, 3, 64), (4, 1, 256), (2, 2, 256)])
@pytest.mark.parametrize("window,softcap,rows", WINDOW_CASES)
def test_attention_window_ring_softcap_match_float64_reference(attention, H, Hkv, D, dtype, window, softcap, rows):
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(len(rows), (H + 2 * Hkv) * D + 5, generator=g)[:, : (H + 2 * Hkv) * D]
    caches = [(torch.randn(2, Hkv, cap, D, generator=g) * 2).to(dtype) for _, cap in rows]
    before = [kv.clone() for kv in caches]
    positions = [p for p, _ in rows]
    out = attention(qkv, caches, positions, D ** -0.5, window, softcap)
    for i, (p, cap) in enumerate(rows):
        want = reference_window(qkv[i], before[i], p, H, Hkv, D, window, softcap)
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=2e-6)
        slot = p % cap
        assert torch.equal(caches[i][0, :, slot], qkv[i, H * D:(H + Hkv) * D].view(Hkv, D).to(dtype))
        assert torch.equal(caches[i][1, :, slot], qkv[i, (H + Hkv) * D:].view(Hkv, D).to(dtype))
        others = torch.arange(cap) != slot
        assert torch.equal(caches[i][:, :, others], before[i][:, :, others])


def ring_of(keys: torch.Tensor, first: int, cap: int, g: torch.Generator) -> torch.Tensor:
    """A cache [2, Hkv, cap, D] of random slots that holds keys [2, Hkv, n, D] as positions
    first .. first + n - 1, each at slot p % cap."""
    kv = (torch.randn(keys.shape[0], keys.shape[1], cap, keys.shape[3], generator=g) * 2).to(keys.dtype)
    kv[:, :, torch.arange(first, first + keys.shape[2]) % cap] = keys
    return kv


# (span length, [(capacity, keys before the wrap), ...]): wraps after one key, inside a score
# block and a value block (37: not a multiple of 4, 8, 16 or 32), on a block's edge, before the
# last key, and in a row of 1100 keys (three spans of up to 512) inside each of its spans.
RING_CASES = [(100, [(100, 1), (100, 37), (128, 64), (150, 99), (101, 50)]),
              (1100, [(1100, 515), (1300, 1031), (1100, 300)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 1, 256), (6, 3, 64)])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("L,rings", RING_CASES)
def test_attention_ring_gives_the_bits_of_a_contiguous_cache(attention, H, Hkv, D, dtype, softcap, L, rings):
    """A row's L keys in a cache of every position (no window) and in rings wrapped at various
    places (a window of L): the same bits, the order of operations fixed by L alone."""
    g = torch.Generator().manual_seed(L)
    qkv = torch.randn(1, (H + 2 * Hkv) * D, generator=g)
    keys = (torch.randn(2, Hkv, L, D, generator=g) * 2).to(dtype)
    flat = torch.cat([keys, (torch.randn(2, Hkv, 3, D, generator=g)).to(dtype)], dim=2)
    want = attention(qkv, [flat], [L - 1], D ** -0.5, 0, softcap)
    for cap, before_wrap in rings:
        first = 2 * cap - before_wrap  # slot cap - before_wrap, a lap into the ring
        kv = ring_of(keys, first, cap, g)
        got = attention(qkv, [kv], [first + L - 1], D ** -0.5, L, softcap)
        assert torch.equal(got, want), (cap, before_wrap)
        assert torch.equal(kv[:, :, (first + L - 1) % cap], flat[:, :, L - 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_prefill_with_window_and_ring_gives_each_row_the_bits_of_decoding_it(path, dtype, softcap):
    """A chunk of T rows with a window of w over a ring, wrapped at various places, attends as
    the same keys in a cache of every position do, and as each row's decoding step does."""
    H, Hkv, D, w, T = 4, 1, 256, 600, 40
    M = w - 1 + T  # the chunk's keys: from its first row's first key to its last position
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    keys = (torch.randn(2, Hkv, M, D, generator=g) * 2).to(dtype)
    keys[:, :, w - 1:] = qkv[:, H * D:].view(T, 2, Hkv, D).permute(1, 2, 0, 3).to(dtype)
    q = qkv[:, : H * D]
    want = path.prefill_attention(q, ring_of(keys, 0, M, g), w - 1, D ** -0.5, w, softcap)
    # The same rows past a window that reaches back to 0: their keys at the cache's start.
    assert torch.equal(path.prefill_attention(q, keys.clone(), w - 1, D ** -0.5, 0, softcap)[0], want[0])
    for cap, before_wrap in [(M, 1), (M, 37), (M + 9, 520), (M, M - 1)]:
        first = 3 * cap - before_wrap
        kv = ring_of(keys, first, cap, g)
        got = path.prefill_attention(q, kv, first + w - 1, D ** -0.5, w, softcap)
        assert torch.equal(got, want), (cap, before_wrap)
        for i in (0, 1, 17, T - 1):
            step = path.attention(qkv[i:i + 1], [kv.clone()], [first + w - 1 + i], D ** -0.5, w, softcap)
            assert torch.equal(step[0], want[i]), (cap, before_wrap, i)


def test_window_and_softcap_bad_arguments_are_errors_with_messages(path):
    H, Hkv, D = 4, 1, 64
    qkv, pool, caches = make(1, H, Hkv, D, cap=64)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        path.attention(qkv, caches, [3], 0.25, -1, 0.0)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        path.attention(qkv, caches, [3], 0.25, 0, -1.0)
    with pytest.raises(RuntimeError, match="softcap must be finite"):
        path.attention(qkv, caches, [3], 0.25, 0, float("inf"))
    with pytest.raises(RuntimeError, match=r"200 \(attending 100 .. 200\) is outside cache 0 of capacity 64"):
        path.attention(qkv, caches, [200], 0.25, 101, 0.0)
    path.attention(qkv, caches, [200], 0.25, 64, 0.0)  # a full ring
    with pytest.raises(RuntimeError, match="multiple of 16 up to 256, not 272"):
        path.attention(torch.randn(1, 3 * 272), [torch.zeros(2, 1, 8, 272)], [0], 0.25)
    q, kv = qkv[:, : H * D], caches[0]
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        path.prefill_attention(q, kv, 3, 0.25, -2, 0.0)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        path.prefill_attention(q, kv, 3, 0.25, 0, -0.5)
    with pytest.raises(RuntimeError, match="outside the cache of capacity 64"):
        path.prefill_attention(q.expand(10, -1), kv, 200, 0.25, 60, 0.0)  # keys 141 .. 209: 69
    path.prefill_attention(q.expand(5, -1), kv, 200, 0.25, 60, 0.0)  # keys 141 .. 204: 64
    with pytest.raises(RuntimeError, match="multiple of 16 up to 256, not 272"):
        path.prefill_attention(torch.randn(1, 272), torch.zeros(2, 1, 8, 272), 0, 0.25)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 values lie between a and b (of one sign or across zero)."""
    def ordered(x):
        i = x.view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


def test_softcap_tanh_is_within_an_ulp_or_two(path):
    op = getattr(torch.ops.ds4, f"attention_softcap_{'avx512' if path.name == 'amx' else path.name}")
    tiny = torch.logspace(-40, 1.5, 4001)
    x = torch.cat([torch.linspace(-12, 12, 48001), tiny, -tiny, torch.tensor(
        [0.0, 0.625, -0.625, 0.6249999, 0.6250001, 1e-45, 88.0, -88.0, 1e4, -1e4, 3e38, -3e38])]).float()
    got = op(x, 1.0)  # 1 tanh(x / 1): tanh itself
    assert ulps(got, torch.tanh(x.double()).float()).max() <= 2
    assert torch.equal(got[x == 0], x[x == 0])  # signed zeros kept
    # A cap of 30, and lengths that leave a partial vector.
    y = torch.linspace(-100, 100, 37)
    for n in (1, 5, 16, 37):
        want = 30 * torch.tanh(y[:n].double() / 30)
        torch.testing.assert_close(op(y[:n], 30.0).double(), want, rtol=5e-7, atol=0)


def test_engine_decoding_agrees_with_the_torch_ops_path(tiny_gguf, path):
    import engine

    m = engine.load_model(tiny_gguf("qwen3", "Q8_0"), cpu_kernels=path.name)
    assert m.net.attention_kernel is path.attention
    ids = list(range(5, 60))
    fast = m.new_session()
    fast.sync(ids[:20])
    steps_fast = []
    for t in ids[20:]:
        fast.eval(t)
        steps_fast.append(fast.logits.clone())
    m.net.attention_kernel = None
    plain = m.new_session()
    plain.sync(ids[:20])
    for t, want in zip(ids[20:], steps_fast):
        plain.eval(t)
        torch.testing.assert_close(plain.logits, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- a decoding layer's halves in one op


def block_matrix(kind: str, rows: int, cols: int, seed: int) -> list[torch.Tensor]:
    """A random matrix's operands as the block ops take them: int4 (packed, scales), int4 with
    5-bit codes (packed, scales, high) or IQ4 levels (packed, scales, levels), int8 with group 32
    (q, scales), int8 with group 16 and minimums (q, scales, minimums), or Q6_K, Q3_K or Q2_K
    tiles (packed, sc, d[, dmin]; widths divisible by 256)."""
    if kind in ("int5", "iq4"):
        packed, scales, high, levels, _ = coded_case(rows, cols, "q5" if kind == "int5" else "iq4", seed=seed)
        return [packed, scales, high if high is not None else levels]
    if kind == "int4":
        q, scale, minimum, _ = int4_case(rows, cols, seed=seed)
        return list(int4_pack(q, scale, minimum))
    if kind in ("q6", "q3", "q2"):
        from gguf import GGMLQuantizationType as QT

        qtype = {"q6": QT.Q6_K, "q3": QT.Q3_K, "q2": QT.Q2_K}[kind]
        raw = torch.from_numpy(raw_matrix(qtype, rows, cols, seed=seed))
        *w, dmin = kernels.cpu_kernels("portable").repack_kq([raw], int(qtype), torch.arange(rows), cols, 16)
        return w + ([dmin] if dmin.numel() else [])
    group = 32 if kind == "int8" else 16
    q, scales, _ = int8_case(rows, cols, group, seed=seed)
    if kind == "int8":
        return [q, scales]
    return [q, scales, torch.rand(scales.shape, generator=torch.Generator().manual_seed(seed)) * 0.01]


def int4_codes(w: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An int4 matrix's (high, levels) from its third operand, where it has one."""
    third = w[2] if len(w) == 3 else None
    if third is None:
        return None, None
    return (third, None) if third.dtype == torch.uint8 else (None, third)


def is_kq(w: list[torch.Tensor]) -> bool:
    return len(w) in (3, 4) and w[0].dtype == torch.uint8 and w[1].dtype == torch.int8


def product(path, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    if is_kq(w):
        return path.kq(x, *w)
    return path.int4(x, w[0], w[1], *int4_codes(w)) if w[0].dtype == torch.uint8 else path.int8(x, *w)


def add_product(path, x: torch.Tensor, w: list[torch.Tensor], out: torch.Tensor) -> None:
    if w[0].dtype == torch.uint8 and not is_kq(w):
        path.int4_add(x, w[0], w[1], out, *int4_codes(w))
    else:
        out += product(path, x, w)


BLOCK_KINDS = ["int4", "int8", "int8-minimums", "int5", "iq4", "q6", "q3", "q2"]


def skip_unless_taken(path, kind: str) -> None:
    if kind in ("int5", "iq4") and not path.int4_codes:
        pytest.skip(f"the {path.name} path takes no 5-bit or IQ4 codes")
    if kind in ("q6", "q3", "q2") and path.kq is None:
        pytest.skip(f"the {path.name} path keeps Q6_K, Q3_K and Q2_K in the int8 op")


def block_case(n: int, seed: int, dtype: torch.dtype, kind: str = "int4", D: int = 32):
    """A layer of E = 128, H = 4 query heads over Hkv = 2 kv heads of D, matrices of `kind`,
    and n rows at distinct positions of their own caches, with a few large residual values
    (where a last-bit difference before the bfloat16 rounding shows).  The k-quant tiles'
    matrices need widths divisible by 256: E = 256, F = 256 and D = 64 for them."""
    E, H, Hkv, F = 128, 4, 2, 96
    if kind in ("q6", "q3", "q2"):
        E, F, D = 256, 256, 64
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int, s: int):
        return block_matrix(kind, rows, cols, seed * 10 + s)
    x = torch.randn(n, E, generator=g)
    x[:, 7] *= 60
    pos = [3 + 5 * i for i in range(n)]
    angles = torch.tensor(pos, dtype=torch.float64)[:, None] * torch.rand(D // 2, generator=g, dtype=torch.float64)
    turns = torch.polar(torch.ones(n, D // 2, dtype=torch.float64), angles)
    caches = [(torch.randn(2, Hkv, 40, D, generator=g) * 2).to(dtype) for _ in range(n)]
    return dict(x=x, norm=torch.rand(E, generator=g) + 0.5, post_norm=torch.rand(E, generator=g) + 0.5,
                head_norms=[torch.rand(D, generator=g) + 0.5 for _ in range(2)],
                qkv=matrix((H + 2 * Hkv) * D, E, 1), wo=matrix(E, H * D, 2), gate_up=matrix(2 * F, E, 3),
                down=matrix(E, F, 4), rope=turns.to(torch.complex64), caches=caches, pos=pos, H=H, Hkv=Hkv, D=D)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3])
def test_attention_block_gives_the_bits_of_its_ops_in_sequence(path, n, dtype, kind, window):
    skip_unless_taken(path, kind)
    c = block_case(n, seed=n, dtype=dtype, kind=kind)
    H, Hkv, D, eps = c["H"], c["Hkv"], c["D"], 1e-5
    x, caches = c["x"].clone(), [kv.clone() for kv in c["caches"]]
    qkv = product(path, path.rms_norm(x, c["norm"], eps), c["qkv"])
    torch.view_as_complex(qkv.view(n, -1, D // 2, 2))[:, : H + Hkv].mul_(c["rope"].unsqueeze(1))
    add_product(path, path.attention(qkv, caches, c["pos"], D ** -0.5, window), c["wo"], x)

    got, got_caches = c["x"].clone(), [kv.clone() for kv in c["caches"]]
    turns = torch.view_as_real(c["rope"]).reshape(n, D)
    path.attention_block(got, c["norm"], eps, c["qkv"], turns, got_caches, c["pos"], window, D ** -0.5, c["wo"])
    assert torch.equal(got, x)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, caches))


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_ffn_block_gives_the_bits_of_its_ops_in_sequence(path, n, kind):
    skip_unless_taken(path, kind)
    c = block_case(n, seed=5 + n, dtype=torch.float32, kind=kind)
    x = c["x"].clone()
    add_product(path, path.swiglu(product(path, path.rms_norm(x, c["norm"], 1e-5), c["gate_up"])), c["down"], x)
    got = c["x"].clone()
    path.ffn_block(got, c["norm"], 1e-5, c["gate_up"], c["down"])
    assert torch.equal(got, x)


def test_block_ops_bad_arguments_are_errors_with_messages(path):
    c = block_case(1, seed=9, dtype=torch.float32)
    D = c["D"]
    turns = torch.view_as_real(c["rope"]).reshape(1, D)
    args = (c["norm"], 1e-5, c["qkv"])
    with pytest.raises(RuntimeError, match=r"attention_block: x must be contiguous float32"):
        path.attention_block(c["x"].repeat(1, 2)[:, ::2], *args, turns, c["caches"], c["pos"], 0, 0.2, c["wo"])
    with pytest.raises(RuntimeError, match=r"attention_block: rope must be float32 \[N, head dim\]"):
        path.attention_block(c["x"].clone(), *args, turns[:, :-2], c["caches"], c["pos"], 0, 0.2, c["wo"])
    narrow = [kv[:, :1] for kv in c["caches"]]  # caches of fewer heads than the projection's width
    with pytest.raises(RuntimeError, match=r"attention_block: the q/k/v projection's width"):
        path.attention_block(c["x"].clone(), *args, turns, narrow, c["pos"], 0, 0.2, c["wo"])
    with pytest.raises(RuntimeError, match=r"attention_block: qkv must be int4 operands"):
        path.attention_block(c["x"].clone(), c["norm"], 1e-5, [c["qkv"][0].float(), c["qkv"][1]], turns,
                             c["caches"], c["pos"], 0, 0.2, c["wo"])
    with pytest.raises(RuntimeError, match=r"ffn_block: x must be contiguous float32"):
        path.ffn_block(c["x"].double(), c["norm"], 1e-5, c["gate_up"], c["down"])
    with pytest.raises(RuntimeError, match=r"ffn_block: down must be int4 operands"):
        path.ffn_block(c["x"].clone(), c["norm"], 1e-5, c["gate_up"], c["down"][:1])


def neox_rotation(path, qkv: torch.Tensor, H: int, norms: list[torch.Tensor | None], cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """rotate_halves as Gemma's torch step computes it: the q and k heads normed with rms_norm,
    then a * cos - b * sin, b * cos + a * sin on their halves; the value heads as they were."""
    N, D = qkv.shape[0], 2 * cos.shape[1]
    heads = qkv.view(N, -1, D).clone()
    Hkv = (heads.shape[1] - H) // 2
    for lo, hi, w in ((0, H, norms[0]), (H, H + Hkv, norms[1])):
        part = heads[:, lo:hi]
        if w is not None:
            part = path.rms_norm(part.reshape(-1, D), w, 1e-6).view(N, hi - lo, D)
        a, b = part[..., : D // 2], part[..., D // 2:]
        c, s = cos[:, None], sin[:, None]
        heads[:, lo:hi] = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return heads.view(N, -1)


def gemma_rope(n: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, D // 2, generator=g, dtype=torch.float64) * 40
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("with_norms", [False, True])
@pytest.mark.parametrize("D", [32, 256])
def test_rotate_halves_gives_the_bits_of_the_torch_rotation(path, D, with_norms):
    n, H, Hkv = 3, 4, 2
    g = torch.Generator().manual_seed(D)
    qkv = torch.randn(n, (H + 2 * Hkv) * D, generator=g) * 3
    strided = torch.zeros(n, qkv.shape[1] + 16)[:, 8: 8 + qkv.shape[1]]  # rows of a wider tensor
    strided.copy_(qkv)
    norms = [torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5] if with_norms else [None, None]
    cos, sin = gemma_rope(n, D, seed=D + 1)
    want = neox_rotation(path, qkv, H, norms, cos, sin)
    path.rotate_halves(strided, H, norms[0], norms[1], 1e-6, cos, sin)
    assert torch.equal(strided, want)


def test_rotate_halves_bad_arguments_are_errors_with_messages(path):
    cos, sin = gemma_rope(1, 32, seed=0)
    with pytest.raises(RuntimeError, match=r"rotate_halves: qkv's width 224 is not 4 query heads"):
        path.rotate_halves(torch.zeros(1, 7 * 32), 4, None, None, 1e-6, cos, sin)
    with pytest.raises(RuntimeError, match=r"rotate_halves: q_norm must be contiguous float32 \[32\]"):
        path.rotate_halves(torch.zeros(1, 8 * 32), 4, torch.ones(16), None, 1e-6, cos, sin)
    with pytest.raises(RuntimeError, match=r"rotate_halves: cos and sin must be float32"):
        path.rotate_halves(torch.zeros(1, 8 * 32), 4, None, None, 1e-6, cos.double(), sin)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (9, 2.5)])
@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_gemma_attention_block_gives_the_bits_of_its_ops_in_sequence(path, n, kind, window, softcap):
    skip_unless_taken(path, kind)
    c = block_case(n, seed=20 + n, dtype=torch.float16, kind=kind, D=64)
    H, D, eps, scale = c["H"], c["D"], 1e-6, 0.3
    cos, sin = gemma_rope(n, D, seed=n)
    x, caches = c["x"].clone(), [kv.clone() for kv in c["caches"]]
    qkv = product(path, path.rms_norm(x, c["norm"], eps), c["qkv"])
    path.rotate_halves(qkv, H, *c["head_norms"], eps, cos, sin)
    att = path.attention(qkv, caches, c["pos"], scale, window, softcap)
    x += path.rms_norm(product(path, att, c["wo"]), c["post_norm"], eps)

    got, got_caches = c["x"].clone(), [kv.clone() for kv in c["caches"]]
    path.gemma_attention_block(got, c["norm"], c["post_norm"], eps, c["qkv"], *c["head_norms"], cos, sin, got_caches,
                               c["pos"], window, scale, softcap, c["wo"])
    assert torch.equal(got, x)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, caches))


@pytest.mark.parametrize("kind", BLOCK_KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_gemma_ffn_block_gives_the_bits_of_its_ops_in_sequence(path, n, kind):
    skip_unless_taken(path, kind)
    c = block_case(n, seed=30 + n, dtype=torch.float32, kind=kind)
    x = c["x"].clone()
    act = path.geglu(product(path, path.rms_norm(x, c["norm"], 1e-6), c["gate_up"]))
    x += path.rms_norm(product(path, act, c["down"]), c["post_norm"], 1e-6)
    got = c["x"].clone()
    path.gemma_ffn_block(got, c["norm"], c["post_norm"], 1e-6, c["gate_up"], c["down"])
    assert torch.equal(got, x)


@pytest.mark.parametrize("arch,qtype,kw", [("llama", "Q4_1", {}), ("qwen2", "Q4_1", {}), ("qwen3", "Q4_1", {}),
                                           ("llama", "Q4_1", {"extra_metadata": {"llama.attention.sliding_window": 7}}),
                                           ("llama", "Q8_0", {}), ("llama", "Q5_1", {}),
                                           ("llama", "Q5_K", {"mixture": "Q5_K_M", "n_layer": 3}),
                                           ("llama", "IQ4_NL", {}), ("llama", "Q6_K", {}), ("llama", "Q3_K", {}),
                                           ("llama", "Q2_K", {})],
                         ids=["llama", "qwen2-biases", "qwen3-qk-norms", "llama-window", "int8", "q5_1",
                              "q5_k_m-mixed", "iq4_nl", "q6_k", "q3_k", "q2_k"])
def test_decoding_in_block_ops_gives_the_bits_of_the_python_step(tiny_gguf, path, arch, qtype, kw):
    """Greedy decoding of one row and of three rows in one batch, with the layer halves that fit
    in block ops (qwen2's biased q/k/v and qwen3's q/k norms keep their attention half in
    Python; int4 and int8 matrices, mixed in a Q5_K_M file; Q5_1 and IQ4_NL as int4 codes where
    the path takes them, else int8; Q6_K, Q3_K and Q2_K at their own width where the path has
    them, else int8) and with every half in Python: the same logits and caches, bit for bit."""
    import engine
    from engine.batch import decode_batch

    m = engine.load_model(tiny_gguf(arch, qtype, **kw), cpu_kernels=path.name)
    fused = [(b.wo.vector_operands(1), b.w_down.vector_operands(1)) for b in m.net.blocks]
    assert all(wo is not None and down is not None for wo, down in fused)  # the kinds reach the block ops
    assert m.net.block_ops is path
    assert m.net.window == kw.get("extra_metadata", {}).get("llama.attention.sliding_window")

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        sessions = m.new_sessions(3)
        for i, s in enumerate(sessions):
            s.sync(list(range(5 + i, 17 + 2 * i)))
        logits = []
        for step in range(12):
            ids = [int(s.logits.argmax()) for s in sessions] if step else [40, 41, 42]
            if step % 2:  # alternately one row alone and all three in one step
                sessions[0].eval(ids[0])
            else:
                decode_batch(sessions, ids)
            logits += [s.logits.clone() for s in sessions]
        return logits, [s.cache.kv[:, :, :, : s.cache.n].clone() for s in sessions]

    blocks = run()
    m.net.block_ops = None
    python = run()
    assert all(torch.equal(a, b) for a, b in zip(blocks[0], python[0]))
    assert all(torch.equal(a, b) for a, b in zip(blocks[1], python[1]))


# ---------------------------------------------------------------- int4 products


def int4_ops() -> list[tuple[str, str]]:
    out = [(p, "int4") for p in COMPILED]
    return out + [("amx", "int4_tiles")] if "amx" in COMPILED else out


@pytest.fixture(scope="module", params=int4_ops(), ids="-".join)
def int4_op(request):
    name, field = request.param
    op = getattr(path_kernels(name), field)
    assert op is not None
    return op


def int4_case(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32), dtype=np.float32) * 0.05).astype(np.float32)
    minimum = (-8 * scale * rng.random((n, k // 32), dtype=np.float32)).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
    return q, scale, minimum, torch.from_numpy(w)


@pytest.mark.parametrize("n,k", [(16, 32), (96, 128), (960, 576), (48, 1536)])
@pytest.mark.parametrize("m", [1, 7, 16, 37])  # the tile kernel's partial and whole row tiles
def test_int4_matches_the_dequantized_matmul(int4_op, n, k, m):
    q, scale, minimum, w = int4_case(n, k)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(m, k + 3)[:, :k]  # strided rows
    y = int4_op(x, packed, scales)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # The kernel rounds x to bfloat16; everything after that is float32 arithmetic.
    want = x.to(torch.bfloat16).double() @ w.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_int4_rounds_activations_like_torch_bfloat16_and_flushes_subnormals(int4_op):
    q = np.ones((16, 32), np.uint8)
    packed, scales = int4_pack(q, np.ones((16, 1), np.float32), np.zeros((16, 1), np.float32))
    halfway = float(torch.tensor([1 + 2 ** -8], dtype=torch.float32))  # a tie: rounds to even (1.0)
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0] = halfway, 1e-39, float("nan")
    y = int4_op(x, packed, scales)
    assert float(y[0, 0]) == float(torch.tensor(halfway).bfloat16().float()) == 1.0
    assert float(y[1, 0]) == 0.0  # a subnormal activation counts as zero, as VCVTNE2PS2BF16 does
    assert torch.isnan(y[2]).all()


def test_int4_rows_are_bitwise_independent_of_the_batch_and_threads(int4_op):
    q, scale, minimum, _ = int4_case(192, 576, seed=3)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(130, 576)
    together = int4_op(x, packed, scales)

    def check(n_threads):
        for rows in ([0], [5, 6, 7, 8, 9], list(range(129, 130)), list(range(3, 40))):
            assert torch.equal(int4_op(x[rows], packed, scales), together[rows]), (n_threads, rows)
    with_threads(check)


def test_int4_bad_arguments_are_errors_with_messages(int4_op):
    q, scale, minimum, _ = int4_case(32, 64)
    packed, scales = int4_pack(q, scale, minimum)
    with pytest.raises(RuntimeError, match="has 32 inputs, the weights 64"):
        int4_op(torch.randn(2, 32), packed, scales)
    with pytest.raises(RuntimeError, match="float32"):
        int4_op(torch.randn(2, 64).double(), packed, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        int4_op(torch.randn(2, 64), packed, scales[:1])
    with pytest.raises(RuntimeError, match="scales must be contiguous float32 or float16"):
        int4_op(torch.randn(2, 64), packed, scales.bfloat16())


def test_int4_empty_input_gives_an_empty_output(int4_op):
    q, scale, minimum, _ = int4_case(32, 64)
    packed, scales = int4_pack(q, scale, minimum)
    assert int4_op(torch.randn(0, 64), packed, scales).shape == (0, 32)


@pytest.mark.parametrize("m", [1, 5, 37])  # 37: AVX2 takes column groups in pairs from 16 rows
@pytest.mark.parametrize("n_out", [192, 181])  # whole column groups, and padding columns dropped
def test_int4_add_gives_the_bits_of_adding_the_product(path, m, n_out):
    """int4_linear_add(x, ..., out) adds into the residual stream itself: bit for bit what
    `out += int4_linear(x, ...)[:, :n_out]` computes, with strided rows of out."""
    q, scale, minimum, _ = int4_case(192, 576, seed=5)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(m, 576)
    base = torch.randn(m, n_out + 4)
    full = base.clone()
    path.int4_add(x, packed, scales, full[:, :n_out])
    assert torch.equal(full[:, :n_out], base[:, :n_out] + path.int4(x, packed, scales)[:, :n_out])
    assert torch.equal(full[:, n_out:], base[:, n_out:])  # nothing written past the given columns


def test_int4_add_refuses_an_output_of_the_wrong_shape(path):
    q, scale, minimum, _ = int4_case(32, 64)
    packed, scales = int4_pack(q, scale, minimum)
    for bad in (torch.zeros(2, 16), torch.zeros(3, 32), torch.zeros(2, 33), torch.zeros(2, 32).double()):
        with pytest.raises(RuntimeError, match=r"int4_linear_add: out must be float32 \[2, 17..32\]"):
            path.int4_add(torch.randn(2, 64), packed, scales, bad)


def gguf_int4_scales(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random GGUF matrix of `qtype` in the int4 kernels' layout.  "Q4_K/pow2": Q4_K whose
    super-block scales d and dmin are powers of two, so that its scales d * sc and minimums
    dmin * m (6-bit sc, m) are exactly float16 values, unlike Q4_K's in general."""
    from gguf import GGMLQuantizationType as QT

    from engine.quants import unpack_int4_groups

    name, _, variant = qtype.partition("/")
    raw = raw_matrix(QT[name], n, k, seed)
    if variant == "pow2":
        blocks_ = raw.reshape(n, k // 256, 144)
        blocks_[:, :, 0:2] = np.array([2 ** -7], np.float16).view(np.uint8)
        blocks_[:, :, 2:4] = np.array([2 ** -9], np.float16).view(np.uint8)
    g = unpack_int4_groups(QT[name], raw, k)
    return int4_pack(g.q, g.scale, g.minimum)


@pytest.mark.parametrize("qtype,half", [("Q4_0", True), ("Q4_1", True), ("Q4_K/pow2", True), ("Q4_K", False)])
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (304, 1536)])
def test_int4_float16_scales_give_the_bits_of_float32_ones(int4_op, qtype, half, n, k):
    """Scales that are exactly float16 values are packed as float16, and the kernels widen them
    exactly: every row count's result is the float32-scale result, bit for bit."""
    packed, scales = gguf_int4_scales(qtype, n, k, seed=n)
    assert scales.dtype == (torch.float16 if half else torch.float32)
    wide = scales.float()
    for rows in (1, 3, 17, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-3, 3, k)
        y = int4_op(x, packed, scales)
        assert torch.isfinite(y).all() and torch.equal(y, int4_op(x, packed, wide)), (qtype, rows)


def test_int4_scales_are_float16_only_where_every_value_round_trips():
    assert exact_scale_dtype(np.array([0.5, -4.0, -0.0, 2 ** -24, 65504.0], np.float32)) == np.float16
    for inexact in (0.1, 65520.0, 1e5, 2 ** -26):  # rounded, rounded up to infinity, beyond it, to zero
        assert exact_scale_dtype(np.array([0.5, inexact], np.float32)) == np.float32, inexact


def test_avx2_and_avx512_int4_products_are_the_same_bits():
    """The AVX2 kernel sums a group's products in the order VDPBF16PS specifies, with fused
    multiply-adds, so the two paths agree bit for bit (subnormal intermediates aside)."""
    if not {"avx2", "avx512"} <= set(COMPILED):
        pytest.skip("needs a CPU with AVX512-BF16 (it runs the AVX2 path too)")
    a, b = path_kernels("avx2").int4, path_kernels("avx512").int4
    for n in (960, 976):  # AVX2 takes several rows' column groups in pairs: 61 groups leave one alone
        q, scale, minimum, _ = int4_case(n, 1536, seed=5)
        packed, scales = int4_pack(q, scale, minimum)
        for rows in (1, 2, 37):
            x = torch.randn(rows, 1536) * torch.logspace(-3, 3, 1536)  # wide exponents within a group
            assert torch.equal(a(x, packed, scales), b(x, packed, scales)), (n, rows)


@pytest.mark.parametrize("other", ["portable", "amx"])
def test_other_int4_kernels_differ_from_the_vector_kernel_only_in_the_last_bits(other):
    if other not in COMPILED:
        pytest.skip(f"this CPU does not run the {other} path")
    base = next(p for p in ("avx512", "avx2", "portable") if p in COMPILED and p != other)
    ks = path_kernels(other)
    op = ks.int4_tiles if other == "amx" else ks.int4
    q, scale, minimum, _ = int4_case(960, 576, seed=5)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(48, 576)
    want, got = path_kernels(base).int4(x, packed, scales), op(x, packed, scales)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


# ---------------------------------------------------------------- 5-bit codes and IQ4 levels


CODED = [p for p in COMPILED if p in ("avx512", "amx")]  # the paths whose int4 op takes codes


@pytest.fixture(scope="module", params=CODED)
def coded_path(request) -> kernels.CpuKernels:
    ks = path_kernels(request.param)
    assert ks.int4_codes
    return ks


def coded_case(n: int, k: int, kind: str, seed: int = 0):
    """A random coded matrix in the int4 op's operands (packed, scales, high, levels) and its
    float64 weights: "q5" codes 0..31 with scales and minimums (Q5_0/Q5_1/Q5_K's form), "iq4"
    codes 0..15 naming IQ4_NL's levels, with scales only."""
    from engine.quants import IQ4_LEVELS
    from engine.weights import fifth_bits

    rng = np.random.default_rng(seed)
    scale = (rng.random((n, k // 32), dtype=np.float32) * 0.05).astype(np.float32)
    if kind == "q5":
        codes = rng.integers(0, 32, size=(n, k), dtype=np.uint8)
        minimum = (-16 * scale * rng.random((n, k // 32), dtype=np.float32)).astype(np.float32)
        values, high, levels = codes.astype(np.float64), fifth_bits(codes), None
    else:
        codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        minimum = np.zeros_like(scale)
        values, high, levels = IQ4_LEVELS[codes].astype(np.float64), None, torch.from_numpy(IQ4_LEVELS.astype(np.float32))
    w = values * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
    packed, scales = int4_pack(codes & 0x0F, scale, minimum)
    return packed, scales, high, levels, torch.from_numpy(w)


@pytest.mark.parametrize("kind", ["q5", "iq4"])
@pytest.mark.parametrize("n,k", [(16, 32), (96, 128), (960, 576)])
@pytest.mark.parametrize("m", [1, 7, 37])
def test_coded_int4_matches_the_dequantized_matmul(coded_path, kind, n, k, m):
    packed, scales, high, levels, w = coded_case(n, k, kind, seed=n + m)
    x = torch.randn(m, k + 3)[:, :k]  # strided rows
    y = coded_path.int4(x, packed, scales, high, levels)
    want = x.to(torch.bfloat16).double() @ w.T  # as the plain op: x rounded to bfloat16, float32 after
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["q5", "iq4"])
def test_coded_rows_are_bitwise_independent_and_add_as_the_product(coded_path, kind):
    packed, scales, high, levels, _ = coded_case(192, 576, kind, seed=3)
    x = torch.randn(40, 576)
    together = coded_path.int4(x, packed, scales, high, levels)

    def check(n_threads):
        for rows in ([0], [5, 6, 7], list(range(3, 40))):
            assert torch.equal(coded_path.int4(x[rows], packed, scales, high, levels), together[rows]), (n_threads, rows)
    with_threads(check)
    base = torch.randn(40, 190)
    out = base.clone()
    coded_path.int4_add(x, packed, scales, out[:, :181], high, levels)
    assert torch.equal(out[:, :181], base[:, :181] + together[:, :181]) and torch.equal(out[:, 181:], base[:, 181:])


def test_codes_that_a_plain_matrix_also_has_give_its_bits(coded_path):
    """Zero fifth bits, or the levels 0..15, are the plain 4-bit op: the same bits."""
    q, scale, minimum, _ = int4_case(96, 576, seed=7)
    packed, scales = int4_pack(q, scale, minimum)
    no_high = torch.zeros(96 // 16, 576 // 32, 16, 4, dtype=torch.uint8)
    identity = torch.arange(16, dtype=torch.float32)
    for rows in (1, 5, 37):
        x = torch.randn(rows, 576) * torch.logspace(-3, 3, 576)
        plain = coded_path.int4(x, packed, scales)
        assert torch.equal(coded_path.int4(x, packed, scales, no_high), plain)
        assert torch.equal(coded_path.int4(x, packed, scales, None, identity), plain)


def test_coded_bad_arguments_are_errors_with_messages(coded_path):
    packed, scales, high, levels, _ = coded_case(32, 64, "q5")
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"high must be contiguous uint8 \[N/16, K/32, 16, 4\]"):
        coded_path.int4(x, packed, scales, high[:, :1])
    iq4 = coded_case(32, 64, "iq4")[3]
    with pytest.raises(RuntimeError, match="levels and high bits do not go together"):
        coded_path.int4(x, packed, scales, high, iq4)
    with pytest.raises(RuntimeError, match=r"levels must be contiguous float32 \[16\]"):
        coded_path.int4(x, packed, scales, None, iq4[:8])
    for bad in (0.5, 300.0, float("nan")):
        with pytest.raises(RuntimeError, match="levels must be integers of magnitude at most 256"):
            coded_path.int4(x, packed, scales, None, torch.cat([iq4[:15], torch.tensor([bad])]))


def test_paths_without_codes_refuse_them_and_keep_such_types_in_int8(path):
    """The avx2 and portable int4 ops have no table lookup to make codes cheap: they refuse
    them, and those paths keep the Q5 and IQ4 types in the int8 op."""
    from gguf import GGMLQuantizationType as QT

    from engine.gguf_file import TensorRecord
    from engine.weights import Int8Linear, build_linear

    packed, scales, high, _, _ = coded_case(32, 64, "q5")
    record = TensorRecord("w", QT.Q5_1, (32, 512), raw_matrix(QT.Q5_1, 32, 512, seed=1))
    lin = build_linear([record], "packed", torch.device("cpu"), cpu=path)
    if path.int4_codes:
        assert isinstance(lin, Int4Linear) and lin.high is not None
        return
    assert isinstance(lin, Int8Linear)
    with pytest.raises(RuntimeError, match=f"int4_linear_{path.name}: fifth bits and levels are compiled for avx512 only"):
        path.int4(torch.randn(2, 64), packed, scales, high)
    with pytest.raises(ValueError, match=f"the {path.name} CPU kernels take no 5-bit or IQ4 codes"):
        Int4Linear.from_cpu_layout(packed, scales, 32, path, high=high)


# ---------------------------------------------------------------- int8 and float16 products


def blocks(a: np.ndarray, group: int) -> torch.Tensor:
    n, k = a.shape
    return torch.from_numpy(np.ascontiguousarray(a.reshape(n // 16, 16, k // group, group).transpose(0, 2, 3, 1)))


def int8_case(n: int, k: int, group: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    scale = (rng.random((n, k // group), dtype=np.float32) * 0.01).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scale, group, axis=1)
    return blocks(q, group), blocks(scale, 1)[:, :, 0].contiguous(), torch.from_numpy(w)


def f16_case(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float16)
    kp = -(-k // 32) * 32
    padded = np.zeros((n, kp), np.float16)
    padded[:, :k] = w
    return blocks(padded, 32), torch.from_numpy(w.astype(np.float64))


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_int8_matches_float64(path, group, m):
    q, scales, w = int8_case(64, 256, group)
    x = torch.randn(m, 259)[:, :256]  # strided rows
    y = path.int8(x, q, scales)
    assert y.shape == (m, 64) and y.dtype == torch.float32
    want = x.double() @ w.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("minimums", [None, "float32", "float16"])
def test_int8_float16_scales_give_the_bits_of_float32_ones(path, group, m, minimums):
    """Scales, and minimums, that float16 holds exactly: either dtype, the same bits."""
    q, scales, _ = int8_case(48, 256, group, seed=4)
    scales = scales.half().float()
    x = torch.randn(m, 256)
    if minimums is None:
        assert torch.equal(path.int8(x, q, scales.half()), path.int8(x, q, scales))
        return
    mins = (torch.randn(scales.shape) * 0.01).half().float()
    want = path.int8(x, q, scales, mins)
    narrow = mins.half() if minimums == "float16" else mins
    assert torch.equal(path.int8(x, q, scales.half(), narrow), want)
    assert torch.equal(path.int8(x, q, scales, narrow), want)


def test_int8_minimums_are_float16_only_where_every_value_round_trips():
    from engine.weights import narrowed_if_exact

    exact = torch.tensor([[0.5, -0.25, 3.0]])
    assert narrowed_if_exact(exact).dtype == torch.float16
    assert narrowed_if_exact(exact + 1e-4).dtype == torch.float32  # 1.0001 is no float16
    assert narrowed_if_exact(torch.tensor([[70000.0]])).dtype == torch.float32  # past float16's range


@pytest.mark.parametrize("k", [32, 100, 576])  # 100: a last group of 4 inputs
@pytest.mark.parametrize("m", [1, 5])
def test_f16_matches_float64_including_a_partial_last_group(path, k, m):
    w16, w = f16_case(48, k)
    x = torch.randn(m, k)
    y = path.f16(x, w16)
    want = x.double() @ w.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_dense_rows_are_bitwise_independent_of_the_batch_and_threads(path):
    q, scales, _ = int8_case(96, 512, 32, seed=2)
    w16, _ = f16_case(96, 200, seed=2)
    x8, x16 = torch.randn(40, 512), torch.randn(40, 200)
    together8, together16 = path.int8(x8, q, scales), path.f16(x16, w16)

    def check(n_threads):
        for rows in ([0], [7, 8, 9], list(range(2, 33))):
            assert torch.equal(path.int8(x8[rows], q, scales), together8[rows]), (n_threads, rows)
            assert torch.equal(path.f16(x16[rows], w16), together16[rows]), (n_threads, rows)
    with_threads(check)


def test_dense_bad_arguments_are_errors_with_messages(path):
    q, scales, _ = int8_case(32, 64, 32)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weights 64"):
        path.int8(torch.randn(2, 32), q, scales)
    with pytest.raises(RuntimeError, match="G 16 or 32"):
        path.int8(torch.randn(2, 64), q.view(2, 4, 16, 16)[:, :, :8].contiguous(), scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        path.int8(torch.randn(2, 64), q, scales[:1])
    w16, _ = f16_case(32, 64)
    with pytest.raises(RuntimeError, match="groups of 32"):
        path.f16(torch.randn(2, 96), w16)
    with pytest.raises(RuntimeError, match="float16"):
        path.f16(torch.randn(2, 64), w16.float())
    assert path.int8(torch.randn(0, 64), q, scales).shape == (0, 32)


def test_dense_products_of_two_paths_differ_only_in_the_last_bits():
    if len(COMPILED) < 2:
        pytest.skip("one compiled path on this CPU")
    a, b = (path_kernels(p) for p in COMPILED[-2:])
    q, scales, _ = int8_case(64, 576, 32, seed=4)
    x = torch.randn(9, 576)
    want = a.int8(x, q, scales)
    torch.testing.assert_close(b.int8(x, q, scales), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


# ---------------------------------------------------------------- the engine's use of them


def test_engine_int4_weights_use_the_path_kernels_by_row_count(tiny_gguf, path, monkeypatch):
    import engine
    from engine import weights

    m = engine.load_model(tiny_gguf("llama", "Q4_1"), cpu_kernels=path.name)
    lin = m.net.blocks[0].wqkv
    assert isinstance(lin, Int4Linear) and lin.out_dtype == torch.float32
    calls = []

    def spy(name, op):
        def run(*args):
            calls.append((name, args[0].shape[0]))
            return op(*args)
        return run

    monkeypatch.setattr(lin, "_op", spy("vectors", lin._op))
    if lin._tiles is not None:
        monkeypatch.setattr(lin, "_tiles", spy("tiles", lin._tiles))
    for rows in (1, weights.TILE_MIN_ROWS - 1, weights.TILE_MIN_ROWS):
        lin(torch.randn(rows, lin.in_features))
    many = "tiles" if path.name == "amx" else "vectors"
    assert calls == [("vectors", 1), ("vectors", weights.TILE_MIN_ROWS - 1), (many, weights.TILE_MIN_ROWS)]


def test_without_a_compiler_the_engine_falls_back_to_the_torch_path(tiny_gguf, tmp_path):
    script = (
        "import engine, sys\n"
        "from engine import kernels\n"
        "from engine.weights import RowByRow\n"
        "m = engine.load_model(sys.argv[1])\n"
        "assert m.net.cpu_kernels.name == 'torch', m.net.kernel_path\n"
        "assert isinstance(m.net.blocks[0].wqkv, RowByRow) and m.net.attention_kernel is None\n"
        "s = m.new_session(); s.sync([1, 2, 3]); s.eval(4)\n"
        "print(m.net.kernel_path)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "/bin/false"}
    env.pop(kernels.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", script, tiny_gguf("llama", "Q4_1")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("torch (the best that builds here;") and "/bin/false" in done.stdout


# ---------------------------------------------------------------- building


def test_build_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.build_dir() == tmp_path / "ds4eval" / "kernels"


def test_each_instruction_set_has_its_own_library_file():
    for name, lib in kernels.LIBRARIES.items():
        assert kernels.library_path(lib).name.startswith(f"ds4_kernels_{name}_")


def test_a_build_installs_the_library_atomically_and_leaves_no_work_directory(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    seen = {}

    def fake_load(name, sources, build_directory, **kw):
        seen["dir"] = Path(build_directory)
        seen["flags"] = kw["extra_cflags"]
        (Path(build_directory) / "lock").write_text("")  # what torch's own build lock leaves
        (Path(build_directory) / f"{name}.so").write_bytes(b"library")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    target = tmp_path / "kernels" / "ds4_kernels_avx2_abc.so"
    kernels.build_library(kernels.LIBRARIES["avx2"], target)
    assert target.read_bytes() == b"library"
    assert seen["dir"].parent == target.parent and seen["dir"].name.startswith(".build-")
    assert "-mavx2" in seen["flags"] and "-DDS4_ISA_AVX2" in seen["flags"] and "-march=native" not in seen["flags"]
    assert list(target.parent.iterdir()) == [target]


def test_a_failed_build_installs_nothing_and_removes_its_work_directory(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def failing_load(name, sources, build_directory, **kw):
        (Path(build_directory) / "half.o").write_bytes(b"x")
        raise RuntimeError("error: compiler exploded")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    target = tmp_path / "ds4_kernels_avx2_abc.so"
    with pytest.raises(RuntimeError, match="exploded"):
        kernels.build_library(kernels.LIBRARIES["avx2"], target)
    assert list(tmp_path.iterdir()) == []


def test_only_old_work_directories_of_dead_builds_are_removed(tmp_path):
    old, fresh = tmp_path / ".build-old", tmp_path / ".build-fresh"
    for d in (old, fresh):
        d.mkdir()
        (d / "lock").write_text("")
    now = 10_000_000.0
    os.utime(old, (now - kernels.STALE_BUILD_S - 1,) * 2)
    os.utime(fresh, (now - 5,) * 2)
    kernels.remove_stale_builds(tmp_path, now)
    assert not old.exists() and fresh.exists()


def test_an_installed_library_is_loaded_without_building(tmp_path):
    # The leftovers of an interrupted build (a work directory holding torch's build lock) must
    # not make a later start wait: the installed library is opened directly.  A fresh process,
    # since a library of ops registers them once per process.
    import shutil

    name = COMPILED[0]
    lib = kernels.LIBRARIES["avx512" if name == "amx" else name]
    path_kernels(name)
    installed = kernels.library_path(lib)
    assert installed.is_file()
    root = tmp_path / "ds4eval" / "kernels"
    (root / ".build-dead").mkdir(parents=True)
    (root / ".build-dead" / "lock").write_text("")
    shutil.copy(installed, root / installed.name)
    script = (
        "from torch.utils import cpp_extension\n"
        "def no_build(*a, **kw): raise AssertionError('an installed library was rebuilt')\n"
        "cpp_extension.load = no_build\n"
        "from engine import kernels\n"
        f"assert kernels.load_library({lib.name!r}) is None\n"
        "print('loaded')\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]



# ---------------------------------------------------------------- repacking GGUF blocks at load


def raw_matrix(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    from engine.synthetic import _encode

    rng = np.random.default_rng(seed)
    return _encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.3, qtype, rng).reshape(rows, -1)


def repack_case(qtypes, unpack, fields, cols: int = 512):
    """Random matrices of `qtypes` (raw rows), a row order over all of them, and the `fields` of
    their unpacked forms concatenated in that order and padded with zero rows to blocks of 16."""
    from gguf import GGMLQuantizationType as QT

    raws = [raw_matrix(QT[t], 24 + 8 * i, cols, seed=i) for i, t in enumerate(qtypes)]
    parts = [unpack(QT[t], r, cols) for t, r in zip(qtypes, raws)]
    n = sum(r.shape[0] for r in raws)
    order = np.random.default_rng(9).permutation(n)
    arrays = [np.concatenate([getattr(p, f) for p in parts])[order] for f in fields]
    padded = [np.concatenate([a, np.zeros((-n % 16, a.shape[1]), a.dtype)]) for a in arrays]
    return raws, torch.from_numpy(order.astype(np.int64)), padded


@pytest.mark.parametrize("qtypes", [("Q4_0",), ("Q4_1", "Q4_1"), ("Q4_K",), ("Q4_0", "Q4_1")])
def test_repack_int4_equals_unpacking_then_packing(path, qtypes):
    from gguf import GGMLQuantizationType as QT

    from engine.quants import unpack_int4_groups

    raws, order, arrays = repack_case(qtypes, unpack_int4_groups, ("q", "scale", "minimum"))
    want = int4_pack(*arrays)
    got = path.repack_int4([torch.from_numpy(r) for r in raws], [int(QT[t]) for t in qtypes], order, 512, 16)
    # Q4_0 and Q4_1 scales are float16 fields, kept exactly; Q4_K's are products, kept float32.
    assert got[1].dtype == want[1].dtype == (torch.float32 if "Q4_K" in qtypes else torch.float16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("qtypes", [("Q5_0",), ("Q5_1", "Q4_0"), ("Q5_K",), ("Q4_K", "Q5_K", "Q4_1"), ("IQ4_NL",),
                                    ("IQ4_XS", "IQ4_NL")])
def test_repack_codes_equals_unpacking_then_packing(path, qtypes):
    """The coded types straight from their blocks: int4_pack of the codes' low 4 bits, fifth_bits
    of the codes, and the scales and minimums of engine.quants.unpack_coded_groups, rows
    reordered and padded; the 4-bit types among them with zero fifth bits."""
    from gguf import GGMLQuantizationType as QT

    from engine.quants import unpack_coded_groups
    from engine.weights import fifth_bits

    raws, order, (codes, scale, minimum) = repack_case(qtypes, unpack_coded_groups, ("codes", "scale", "minimum"))
    want_packed, want_scales = int4_pack(codes & 0x0F, scale, minimum)
    packed, scales, high = path.repack_codes([torch.from_numpy(r) for r in raws], [int(QT[t]) for t in qtypes],
                                             order, 512, 16)
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales) and scales.dtype == want_scales.dtype
    assert torch.equal(high, fifth_bits(codes))
    assert bool(high.any()) == any(t.startswith("Q5") for t in qtypes)


def test_repack_codes_refuses_what_it_does_not_unpack(path):
    from gguf import GGMLQuantizationType as QT

    raw = torch.from_numpy(raw_matrix(QT.Q5_K, 16, 256, seed=1))
    with pytest.raises(RuntimeError, match="type 8 is not Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/IQ4_NL/IQ4_XS"):
        path.repack_codes([raw], [8], torch.arange(16), 256, 16)
    with pytest.raises(RuntimeError, match="rows of 176 bytes, not 352"):
        path.repack_codes([raw], [int(QT.Q5_K)], torch.arange(16), 512, 16)
    with pytest.raises(RuntimeError, match="need a width divisible by 256"):
        path.repack_codes([raw[:, :88]], [int(QT.Q5_K)], torch.arange(16), 128, 16)
    with pytest.raises(RuntimeError, match="repack_int4: type 13 is not Q4_0/Q4_1/Q4_K"):
        path.repack_int4([raw], [int(QT.Q5_K)], torch.arange(16), 256, 16)


def test_repack_int4_keeps_float32_scales_where_float16_would_overflow(path):
    """A Q4_0 block with d = 10000 has the minimum -8 * d = -80000, beyond float16's range: that
    weight keeps float32 scales (and computes with them); without that row it is float16."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants as gq

    raw = raw_matrix(QT.Q4_0, 16, 256, seed=2)
    raw[3, 18:20] = np.array([10000.0], np.float16).view(np.uint8)  # row 3's second block's d
    packed, scales = path.repack_int4([torch.from_numpy(raw)], [int(QT.Q4_0)], torch.arange(16), 256, 16)
    assert scales.dtype == torch.float32 and float(scales[0, 1, 1, 3]) == -80000.0
    x = torch.randn(2, 256)
    want = x.bfloat16().double() @ torch.from_numpy(gq.dequantize(raw, QT.Q4_0).reshape(16, 256)).double().T
    torch.testing.assert_close(path.int4(x, packed, scales).double(), want, rtol=1e-5,
                               atol=1e-5 * float(want.abs().max()))
    _, rest = path.repack_int4([torch.from_numpy(raw)], [int(QT.Q4_0)], torch.tensor([0, 1, 2, 4, 5]), 256, 16)
    assert rest.dtype == torch.float16


@pytest.mark.parametrize("qtypes", [("Q8_0",), ("Q6_K",), ("Q4_K", "Q6_K"), ("Q5_K", "Q6_K", "Q5_K"),
                                    ("Q5_0", "Q8_0"), ("Q4_0", "Q6_K"), ("Q4_1", "Q5_1"), ("IQ4_NL", "IQ4_XS", "Q6_K"),
                                    ("Q3_K",), ("Q2_K",), ("Q3_K", "Q4_K", "Q6_K"), ("Q2_K", "Q3_K", "Q8_0")])
def test_repack_int8_equals_unpacking_then_laying_out(path, qtypes):
    """The 8-bit form straight from the blocks, alone and fused (a Q4_K_M file's q/k/v with a
    Q6_K v, Q5_K_M's and Q3_K_M's likewise): engine.quants' unpacking, fused at the smallest
    group, rows reordered and padded, in int8_layout's layout, with minimums exactly where a type
    has them."""
    from gguf import GGMLQuantizationType as QT

    from engine.quants import unpack_int8_groups
    from engine.weights import fuse_int8_groups, group_values_layout, int8_layout, narrowed_if_exact

    raws = [raw_matrix(QT[t], 24 + 8 * i, 512, seed=i) for i, t in enumerate(qtypes)]
    g8 = fuse_int8_groups([unpack_int8_groups(QT[t], r, 512) for t, r in zip(qtypes, raws)])
    order = np.random.default_rng(9).permutation(g8.q.shape[0])
    want_q, want_s = int8_layout(g8.q[order], g8.scale[order], g8.group)
    got_q, got_s, got_m = path.repack_int8([torch.from_numpy(r) for r in raws], [int(QT[t]) for t in qtypes],
                                           torch.from_numpy(order.astype(np.int64)), 512, 16)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s) and got_s.dtype == want_s.dtype
    if g8.minimum is None:
        assert got_m.numel() == 0
    else:
        want_m = narrowed_if_exact(group_values_layout(g8.minimum[order]))
        assert torch.equal(got_m, want_m) and got_m.dtype == want_m.dtype
    # and the layout is the one the int8 kernel reads: the product of the dequantized rows
    from gguf import quants as gq

    w = np.concatenate([gq.dequantize(r, QT[t]).reshape(r.shape[0], 512) for t, r in zip(qtypes, raws)])[order]
    x = torch.randn(3, 512)
    want = x.double() @ torch.from_numpy(w.astype(np.float64)).T
    got = (path.int8(x, got_q, got_s) if got_m.numel() == 0 else path.int8(x, got_q, got_s, got_m))[:, :len(order)]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_repack_int8_keeps_q8_0_scales_float16(path):
    from gguf import GGMLQuantizationType as QT

    raw = raw_matrix(QT.Q8_0, 40, 256, seed=3)
    q, scales, minimums = path.repack_int8([torch.from_numpy(raw)], [int(QT.Q8_0)], torch.arange(40), 256, 16)
    assert q.shape == (3, 8, 32, 16) and scales.shape == (3, 8, 16)  # 40 rows padded to 48
    assert scales.dtype == torch.float16 and minimums.numel() == 0  # the file's float16 values
    assert not q[2, :, :, 8:].any() and not scales[2, :, 8:].any()  # padding rows are zero


@pytest.mark.parametrize("qtype_name", ["Q6_K", "Q3_K", "Q2_K"])
def test_kq_gives_the_int8_ops_bits_on_the_same_matrices(path, qtype_name):
    """Q6_K, Q3_K and Q2_K at their own width compute exactly what the int8 op computes from the
    same file's blocks (their weights, scales and minimums, their order of operations): one row,
    several rows, rows of a strided input; several matrices fused, rows reordered and padded."""
    from gguf import GGMLQuantizationType as QT

    if path.kq is None:
        pytest.skip(f"the {path.name} path keeps Q6_K, Q3_K and Q2_K in the int8 op")
    qtype = QT[qtype_name]
    raws = [torch.from_numpy(raw_matrix(qtype, rows, 512, seed=rows)) for rows in (24, 16)]
    order = torch.from_numpy(np.random.default_rng(3).permutation(40).astype(np.int64))
    q8, s8, m8 = path.repack_int8(raws, [int(qtype)] * 2, order, 512, 16)
    int8 = [q8, s8] + ([m8] if m8.numel() else [])
    packed, sc, d, dmin = path.repack_kq(raws, int(qtype), order, 512, 16)
    kq = [packed, sc, d] + ([dmin] if qtype == QT.Q2_K else [])
    tile = {QT.Q6_K: 192, QT.Q3_K: 96, QT.Q2_K: 64}[qtype]
    assert packed.shape == (3, 32, tile) and sc.shape == (3, 32, 16) and d.shape == (3, 2, 16)
    assert dmin.shape == ((3, 2, 16) if qtype == QT.Q2_K else (0, 2, 16))
    share = {QT.Q6_K: 0.7, QT.Q3_K: 0.4, QT.Q2_K: 0.3}[qtype]
    assert sum(t.nbytes for t in kq) < share * sum(t.nbytes for t in int8)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 512, generator=g) * torch.logspace(-2, 2, 512)
        assert torch.equal(path.kq(x, *kq), path.int8(x, *int8))
    wide = torch.randn(2, 1024, generator=g)
    assert torch.equal(path.kq(wide[:, 256:768], *kq), path.int8(wide[:, 256:768].contiguous(), *int8))
    with pytest.raises(RuntimeError, match="kq_linear: x has 256 inputs, the weights 512"):
        path.kq(torch.randn(1, 256), *kq)
    with pytest.raises(RuntimeError, match="kq_linear: dmin, contiguous float16"):  # with Q2_K's tiles only
        path.kq(x, *kq[:3], *([] if qtype == QT.Q2_K else [d]))


def test_repack_kq_refuses_what_it_cannot_lay_out(path):
    from gguf import GGMLQuantizationType as QT

    raw = torch.from_numpy(raw_matrix(QT.Q6_K, 16, 512, seed=1))
    with pytest.raises(RuntimeError, match="repack_kq: type 12 is not Q6_K, Q3_K or Q2_K"):
        path.repack_kq([raw], int(QT.Q4_K), torch.arange(16), 512, 16)
    with pytest.raises(RuntimeError, match="repack_kq: needs matrices of a width divisible by 256"):
        path.repack_kq([raw], int(QT.Q6_K), torch.arange(16), 384, 16)
    with pytest.raises(RuntimeError, match="rows of 420 bytes, not 210"):
        path.repack_kq([raw], int(QT.Q6_K), torch.arange(16), 256, 16)
    with pytest.raises(RuntimeError, match="outside the 16 rows"):
        path.repack_kq([raw], int(QT.Q6_K), torch.tensor([16]), 512, 16)


def test_repack_refuses_rows_of_the_wrong_size(path):
    from gguf import GGMLQuantizationType as QT

    raw = torch.from_numpy(raw_matrix(QT.Q4_0, 16, 256, seed=1))
    with pytest.raises(RuntimeError, match="rows of 144 bytes, not 288"):
        path.repack_int4([raw], [int(QT.Q4_0)], torch.arange(16), 512, 16)
    with pytest.raises(RuntimeError, match="outside the 16 rows"):
        path.repack_int4([raw], [int(QT.Q4_0)], torch.tensor([16]), 256, 16)
    with pytest.raises(RuntimeError, match="not Q4_0/Q4_1/Q4_K"):
        path.repack_int4([raw], [8], torch.arange(16), 256, 16)
    with pytest.raises(RuntimeError, match="repack_int8: type 16 is not an 8-bit grouped or coded type"):
        path.repack_int8([raw], [int(QT.IQ2_XXS)], torch.arange(16), 256, 16)
    with pytest.raises(RuntimeError, match="rows of 144 bytes, not 420"):
        path.repack_int8([raw], [int(QT.Q6_K)], torch.arange(16), 512, 16)


# ---------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("k", [576, 67])  # a multiple of the 16 lanes, and a tail
def test_rms_norm_matches_float64_and_rows_are_bitwise_independent(path, k):
    torch.manual_seed(k)
    x = torch.randn(37, k) * torch.logspace(-3, 3, 37)[:, None]
    w = torch.randn(k)
    eps = 1e-5
    y = path.rms_norm(x, w, eps)
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(y.double(), want, rtol=2e-6, atol=1e-30)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            alone = torch.cat([path.rms_norm(x[i:i + 1], w, eps) for i in range(0, 37, 5)])
        finally:
            torch.set_num_threads(2)
        assert torch.equal(alone, y[0:37:5])
    strided = torch.randn(37, 2 * k)[:, :k].copy_(x)  # rows of a wider buffer: only rows contiguous
    assert torch.equal(path.rms_norm(strided, w, eps), y)


def test_rms_norm_bad_arguments_are_errors_with_messages(path):
    with pytest.raises(RuntimeError, match=r"rms_norm: x must be \[M, K\] float32"):
        path.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"rms_norm: w must be contiguous float32 \[K\]"):
        path.rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-5)


# ---------------------------------------------------------------- swiglu


@pytest.mark.parametrize("f", [1536, 13])  # whole vectors, and a tail
def test_swiglu_is_silu_times_up_within_a_few_ulp_and_elementwise(path, f):
    torch.manual_seed(f)
    gate_up = torch.randn(9, 2 * f + 5)[:, : 2 * f] * 8  # strided rows
    gate_up[0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])  # exp's clamp and the large side
    y = path.swiglu(gate_up)
    g, u = gate_up[:, :f].double(), gate_up[:, f:].double()
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(y.double(), want, rtol=4e-7, atol=1e-30)
    assert not torch.isnan(y).any()
    # a value's result depends on that value alone: rows and positions anywhere give the same bits
    assert torch.equal(path.swiglu(gate_up[3:5].contiguous()), y[3:5])
    shifted = torch.cat([gate_up[:, 1:f], gate_up[:, :1], gate_up[:, f + 1:], gate_up[:, f:f + 1]], dim=1)
    assert torch.equal(path.swiglu(shifted), torch.cat([y[:, 1:], y[:, :1]], dim=1))


def test_swiglu_bad_arguments_are_errors_with_messages(path):
    with pytest.raises(RuntimeError, match=r"swiglu: gate_up must be \[M, 2F\] float32"):
        path.swiglu(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match=r"swiglu: gate_up must be \[M, 2F\] float32"):
        path.swiglu(torch.zeros(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("f", [2048, 13])  # whole vectors, and a tail
def test_geglu_is_tanh_gelu_times_up_within_a_few_ulp_and_elementwise(path, f):
    torch.manual_seed(f)
    gate_up = torch.randn(9, 2 * f + 5)[:, : 2 * f] * 4  # strided rows
    gate_up[0, :4] = torch.tensor([0.0, -0.0, -100.0, 100.0])  # exp's clamp and the large side
    y = path.geglu(gate_up)
    g, u = gate_up[:, :f].double(), gate_up[:, f:].double()
    want = torch.nn.functional.gelu(g, approximate="tanh") * u
    torch.testing.assert_close(y.double(), want, rtol=2e-6, atol=1e-12)  # far left, gelu is about 0
    assert not torch.isnan(y).any()
    assert torch.equal(path.geglu(gate_up[3:5].contiguous()), y[3:5])
    shifted = torch.cat([gate_up[:, 1:f], gate_up[:, :1], gate_up[:, f + 1:], gate_up[:, f:f + 1]], dim=1)
    assert torch.equal(path.geglu(shifted), torch.cat([y[:, 1:], y[:, :1]], dim=1))
    with pytest.raises(RuntimeError, match=r"geglu: gate_up must be \[M, 2F\] float32"):
        path.geglu(torch.zeros(2, 7))
