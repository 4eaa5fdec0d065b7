"""The compiled CPU kernels (decode attention, int4 matmul) against float64 references, and
their row invariance."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kernels
from engine.weights import Int4Linear, int4_pack


@pytest.fixture(scope="module")
def op():
    found = kernels.decode_attention()
    # The project's setup provides a compiler and ninja; a silent fallback here would leave the
    # engine's fast path untested.
    assert found is not None, kernels.unavailable_reason()
    return found


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (9, 3, 64), (8, 8, 32), (8, 2, 128), (6, 1, 48)])
def test_matches_float64_reference_and_stores_kv(op, H, Hkv, D, dtype):
    positions = [0, 14, 15, 16, 47, 300]
    qkv, pool, caches = make(len(positions), H, Hkv, D, cap=320, dtype=dtype)
    before = pool.clone()
    out = op(qkv, caches, positions, D ** -0.5)
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


def test_large_scores_do_not_overflow(op):
    H, Hkv, D = 2, 1, 16
    qkv, pool, caches = make(1, H, Hkv, D, cap=64)
    qkv *= 300  # scores of several thousand: exp must be taken after the max shift
    before = pool.clone()
    out = op(qkv, caches, [40], D ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0].double(), reference(qkv[0], before[:, 0], 40, H, Hkv, D), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_is_bitwise_independent_of_its_batch_and_thread_count(op, dtype):
    H, Hkv, D = 9, 3, 64
    positions = [3, 130, 17, 255, 64]
    qkv, pool, caches = make(len(positions), H, Hkv, D, cap=256, seed=1, dtype=dtype)
    start = pool.clone()
    together = op(qkv, caches, positions, D ** -0.5)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, max(2, threads)):
            torch.set_num_threads(n_threads)
            for i, p in enumerate(positions):
                pool.copy_(start)
                alone = op(qkv[i:i + 1], [caches[i]], [p], D ** -0.5)
                assert torch.equal(alone[0], together[i]), (n_threads, i)
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments_are_errors_with_messages(op):
    qkv, pool, caches = make(2, 4, 2, 16, cap=32)
    with pytest.raises(RuntimeError, match="one cache and one position per row"):
        op(qkv, caches[:1], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="outside cache 1"):
        op(qkv, caches, [1, 32], 0.25)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        op(qkv, [c.double() for c in caches], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="like cache 0"):
        op(qkv, [caches[0], caches[1].half()], [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="width"):
        op(qkv[:, :-16], caches, [1, 2], 0.25)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(torch.randn(1, 4 * 12), [torch.zeros(2, 1, 8, 12)], [0], 0.25)


def test_build_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.build_dir() == tmp_path / "ds4eval" / "kernels"


def test_engine_decoding_agrees_with_the_torch_ops_path(tiny_gguf):
    import engine

    m = engine.load_model(tiny_gguf("qwen3", "Q8_0"))
    assert m.net.attention_kernel is not None
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


# ---------------------------------------------------------------- int4_linear


INT4_OPS = {
    "vectors": (kernels.int4_linear, "the compiler does not target AVX512-BF16 on this CPU"),
    "tiles": (kernels.int4_linear_tiles, "no AMX-BF16 here (CPU, compiler or operating system)"),
}


@pytest.fixture(scope="module", params=sorted(INT4_OPS))
def int4_op(op, request):
    find, why = INT4_OPS[request.param]
    found = find()
    if found is None:
        pytest.skip(why)
    return found


def int4_case(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scale = (rng.random((n, k // 32), dtype=np.float32) * 0.05).astype(np.float32)
    minimum = (-8 * scale * rng.random((n, k // 32), dtype=np.float32)).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
    return q, scale, minimum, torch.from_numpy(w)


@pytest.mark.parametrize("n,k", [(16, 32), (96, 128), (960, 576), (48, 1536)])
@pytest.mark.parametrize("m", [1, 7, 16, 37])  # the tile kernel's partial and whole row tiles
def test_int4_linear_matches_the_dequantized_matmul(int4_op, n, k, m):
    q, scale, minimum, w = int4_case(n, k)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(m, k + 3)[:, :k]  # strided rows
    y = int4_op(x, packed, scales)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # The kernel rounds x to bfloat16; everything after that is float32 arithmetic.
    want = x.to(torch.bfloat16).double() @ w.T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_int4_linear_rows_are_bitwise_independent_of_the_batch_and_threads(int4_op):
    q, scale, minimum, _ = int4_case(192, 576, seed=3)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(130, 576)
    together = int4_op(x, packed, scales)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, max(2, threads)):
            torch.set_num_threads(n_threads)
            for rows in ([0], [5, 6, 7, 8, 9], list(range(129, 130)), list(range(3, 40))):
                assert torch.equal(int4_op(x[rows], packed, scales), together[rows]), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_int4_linear_bad_arguments_are_errors_with_messages(int4_op):
    q, scale, minimum, _ = int4_case(32, 64)
    packed, scales = int4_pack(q, scale, minimum)
    with pytest.raises(RuntimeError, match="has 32 inputs, the weights 64"):
        int4_op(torch.randn(2, 32), packed, scales)
    with pytest.raises(RuntimeError, match="float32"):
        int4_op(torch.randn(2, 64).double(), packed, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        int4_op(torch.randn(2, 64), packed, scales[:1])


def test_int4_linear_empty_input_gives_an_empty_output(int4_op):
    q, scale, minimum, _ = int4_case(32, 64)
    packed, scales = int4_pack(q, scale, minimum)
    assert int4_op(torch.randn(0, 64), packed, scales).shape == (0, 32)


def test_the_two_int4_kernels_differ_only_in_the_last_bits():
    vectors, tiles = kernels.int4_linear(), kernels.int4_linear_tiles()
    if vectors is None or tiles is None:
        pytest.skip("needs both int4 kernels (AVX512-BF16 and AMX-BF16)")
    q, scale, minimum, _ = int4_case(960, 576, seed=5)
    packed, scales = int4_pack(q, scale, minimum)
    x = torch.randn(48, 576)
    a, b = vectors(x, packed, scales), tiles(x, packed, scales)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))


def test_engine_int4_weights_use_the_kernels_by_row_count(tiny_gguf, monkeypatch):
    import engine
    from engine import weights

    if kernels.int4_linear() is None:
        pytest.skip("the compiler does not target AVX512-BF16 on this CPU")
    m = engine.load_model(tiny_gguf("llama", "Q4_1"))
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
    many = "tiles" if lin._tiles is not None else "vectors"
    assert calls == [("vectors", 1), ("vectors", weights.TILE_MIN_ROWS - 1), (many, weights.TILE_MIN_ROWS)]


def test_without_a_compiler_the_engine_falls_back_to_torch_kernels(tiny_gguf, tmp_path):
    import os
    import subprocess
    import sys

    script = (
        "import engine, sys\n"
        "from engine import kernels\n"
        "m = engine.load_model(sys.argv[1])\n"
        "assert kernels.decode_attention() is None and kernels.int4_linear() is None\n"
        "assert kernels.int4_linear_tiles() is None\n"
        "assert m.net.blocks[0].wqkv._op is None\n"
        "s = m.new_session(); s.sync([1, 2, 3]); s.eval(4)\n"
        "print(m.net.attention_path)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", script, tiny_gguf("llama", "Q4_1")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch ops (") and "/bin/false" in done.stdout


def test_a_build_installs_the_library_atomically_and_leaves_no_work_directory(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    seen = {}

    def fake_load(name, sources, build_directory, **kw):
        seen["dir"] = Path(build_directory)
        (Path(build_directory) / "lock").write_text("")  # what torch's own build lock leaves
        (Path(build_directory) / f"{name}.so").write_bytes(b"library")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    target = tmp_path / "kernels" / "ds4_kernels_abc.so"
    kernels.build_library(target)
    assert target.read_bytes() == b"library"
    assert seen["dir"].parent == target.parent and seen["dir"].name.startswith(".build-")
    assert list(target.parent.iterdir()) == [target]


def test_a_failed_build_installs_nothing_and_removes_its_work_directory(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def failing_load(name, sources, build_directory, **kw):
        (Path(build_directory) / "half.o").write_bytes(b"x")
        raise RuntimeError("error: compiler exploded")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    target = tmp_path / "ds4_kernels_abc.so"
    with pytest.raises(RuntimeError, match="exploded"):
        kernels.build_library(target)
    assert list(tmp_path.iterdir()) == []


def test_only_old_work_directories_of_dead_builds_are_removed(tmp_path):
    import os

    old, fresh = tmp_path / ".build-old", tmp_path / ".build-fresh"
    for d in (old, fresh):
        d.mkdir()
        (d / "lock").write_text("")
    now = 10_000_000.0
    os.utime(old, (now - kernels.STALE_BUILD_S - 1,) * 2)
    os.utime(fresh, (now - 5,) * 2)
    kernels.remove_stale_builds(tmp_path, now)
    assert not old.exists() and fresh.exists()


def test_an_installed_library_is_loaded_without_building(tmp_path, op):
    # The leftovers of an interrupted build (a work directory holding torch's build lock) must
    # not make a later start wait: the installed library is opened directly.  A fresh process,
    # since a library of ops registers them once per process.
    import os
    import shutil
    import subprocess
    import sys

    installed = kernels.library_path()
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
        "assert kernels.decode_attention() is not None, kernels.unavailable_reason()\n"
        "print('loaded')\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
