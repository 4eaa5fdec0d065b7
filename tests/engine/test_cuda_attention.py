"""engine.cuda_attention's kernels against their torch references: the decode kernel on a
prefill's rows of one cache stored first, and on decoding rows of pool slots and standalone
caches that store their own keys (with its early cache reads and without; whole graph steps are
in tests/engine/test_cuda_graphs.py); the latent attention kernel on rows of pool
slots and standalone caches at lengths that end in different pieces, head counts that fill the
16-head programs and ones that do not, a prefill's rows of one cache stored first; its inputs'
kernel (the latent's norm, the rotations) against deepseek2's torch ops; the latent workspace's
bound on its scratch and the grouped-query one's on its programs (whose stretched pieces the
decode kernel's tests run).  The kernels run on a CUDA device (gpu-marked) or, where none
is present, under Triton's interpreter (TRITON_INTERPRET=1, float32 and float16 caches: the
interpreter has no bfloat16)."""
from __future__ import annotations

import os

import pytest
import torch

from engine import cuda_attention as ca

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or not ca.AVAILABLE, reason="needs a CUDA device and Triton")]),
           pytest.param("cpu", marks=pytest.mark.skipif(
               not (INTERPRETED and ca.AVAILABLE), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Where the kernel's and the reference's roundings of the probabilities part.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (heads, latent rank, rope width): DeepSeek-V2-Lite's, a head count that leaves the second
# 16-head program part empty, and the test models' small widths.
SHAPES = [(16, 512, 64), (20, 64, 16), (4, 32, 16)]


def usable(device: str, dtype: torch.dtype) -> bool:
    return device == "cuda" or dtype != torch.bfloat16


def table(caches: list[torch.Tensor], positions: list[int], base: torch.Tensor) -> torch.Tensor:
    """The graphs' row table for caches [n_layer, 1, 1, capacity, W] (views of one allocation)."""
    return torch.tensor([[0, p, (c.data_ptr() - base.data_ptr()) // c.element_size(), c.stride(0), c.stride(1),
                          c.stride(2)] for c, p in zip(caches, positions)], device=base.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_latent_rows_of_pool_slots_and_standalone_caches(device, dtype, shape):
    if not usable(device, dtype):
        pytest.skip("no bfloat16 in Triton's interpreter")
    torch.manual_seed(0)
    H, R, E = shape
    W, n_layer, n_ctx = R + E, 2, 300
    pool = torch.randn(n_layer, 1, 3, 1, 320, W, device=device).to(dtype)
    solo = torch.randn(n_layer, 1, 1, 200, W, device=device).to(dtype)
    caches = [pool[:, :, 2], solo, pool[:, :, 0], solo.new_zeros(n_layer, 1, 1, 1, W)]
    pos = [5, 199, 299, 0]  # within a piece, across pieces, the last position, a first token
    q = torch.randn(len(caches), H, W, device=device)
    new = torch.randn(len(caches), W, device=device)
    rows = table(caches, pos, solo)
    work = ca.Workspace.latent(len(caches), H, R, n_ctx, torch.device(device))
    expect = [c.clone() for c in caches]
    for layer in range(n_layer):
        # the absorbed query as a batched product leaves it: [H, B, R] seen as [B, H, R]
        q_lat = q[:, :, :R].transpose(0, 1).contiguous().transpose(0, 1)
        got = ca.latent_attention(q_lat, q[:, :, R:], new, rows, layer, solo, work, 0.11).clone()
        want = ca.reference_latent(q, new, [c[layer, 0, 0] for c in expect], pos, R, 0.11)
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    for c, e in zip(caches, expect):
        assert torch.equal(c, e)  # each new row landed where torch put it, nothing else moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_rows_of_one_cache_stored_first_are_its_causal_prefill(device, dtype):
    """T rows at consecutive positions of one cache, every new row stored before any row
    attends: row i sees the cache's past and rows 0..i."""
    if not usable(device, dtype):
        pytest.skip("no bfloat16 in Triton's interpreter")
    torch.manual_seed(1)
    H, R, E, n_ctx, start, T = 20, 64, 16, 200, 37, 40
    cache = torch.randn(2, 1, 1, n_ctx, R + E, device=device).to(dtype)
    q = torch.randn(T, H, R + E, device=device)
    new = torch.randn(T, R + E, device=device)
    rows = table([cache] * T, list(range(start, start + T)), cache)
    work = ca.Workspace.latent(T, H, R, n_ctx, torch.device(device))
    expect = cache.clone()
    for layer in range(2):
        got = ca.latent_attention(q[:, :, :R], q[:, :, R:], new, rows, layer, cache, work, 0.2,
                                  store_first=True).clone()
        want = ca.reference_latent(q, new, [expect[layer, 0, 0]] * T, list(range(start, start + T)), R, 0.2)
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert torch.equal(cache, expect)


def test_latent_workspace_bounds_its_scratch():
    """Many rows of many heads at a long context: the pieces grow until the partial results fit
    LATENT_PART_BYTES, and every position still lies in some piece."""
    for rows, heads, n_ctx in [(64, 128, 32768), (64, 16, 163840), (1, 16, 4096), (1, 128, 100)]:
        work = ca.Workspace.latent(rows, heads, 512, n_ctx, torch.device("cpu"))
        assert work.part.numel() * 4 <= ca.LATENT_PART_BYTES or work.n_split == 1
        assert work.n_split * work.split >= n_ctx and work.out.shape == (rows, heads * 512)
    short = ca.Workspace.latent(1, 16, 512, 4096, torch.device("cpu"))
    assert short.split == ca.split_size(1, 1, 4096, ca.LATENT_SPLITS)  # a small step keeps its short pieces


def test_workspace_caps_its_programs():
    """max_programs bounds rows x kv heads x pieces (at least one piece a row); a workspace whose
    pieces no longer cover its context says so (`stretch`), one under the cap keeps them all."""
    cpu = torch.device("cpu")
    whole = ca.Workspace(16, 9, 64, 8192, 3, cpu)
    assert (whole.split, whole.n_split, whole.stretch) == (64, 128, False)
    capped = ca.Workspace(16, 9, 64, 8192, 3, cpu, max_programs=512)
    assert (capped.split, capped.n_split, capped.stretch) == (64, 10, True)
    assert 16 * 3 * capped.n_split <= 512 and capped.part.shape == (16, 9, 10, 64)
    assert ca.Workspace(16, 9, 64, 8192, 3, cpu, max_programs=16 * 3 * 128).stretch is False
    assert ca.Workspace(1, 9, 64, 300, 3, cpu, max_programs=10_000).n_split == 5
    tiny = ca.Workspace(64, 32, 64, 4096, 8, cpu, max_programs=256)
    assert (tiny.n_split, tiny.stretch) == (1, True)
    # one row reads its pieces BLOCKS[0] positions at a time, more rows BLOCKS[1], never past a piece
    assert [ca.Workspace(n, 9, 64, 8192, 3, cpu, splits=(s, s, s)).block for n, s in ((1, 64), (2, 64), (1, 32))] \
        == [min(ca.BLOCKS[0], 64), min(ca.BLOCKS[1], 64), min(ca.BLOCKS[0], 32)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(16, 128, 512, 64), (20, 16, 32, 16), (3, 8, 64, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_latent_inputs_match_the_torch_ops(device, shape):
    """q's rope parts and the new cache row from projections that are slices of one tensor, as
    engine.models.deepseek2's `_project` computes them in torch ops."""
    torch.manual_seed(2)
    H, nope, R, E = shape
    B, hd = 5, nope + E
    both = torch.randn(B, H * hd + R + E + 3, device=device)[:, :-3]  # rows wider than the parts
    q, kv = both[:, : H * hd], both[:, H * hd:]
    angles = torch.rand(B, E // 2, device=device) * 6
    turns = torch.stack([angles.cos(), angles.sin()], dim=-1)
    w = torch.rand(R, device=device) + 0.5
    q_rope, new = ca.latent_inputs(q, kv, turns, w, 1e-6, H, nope)
    rope = torch.view_as_complex(turns.contiguous())

    def rotate(x, turn):  # adjacent pairs times the complex turns
        return torch.view_as_real(torch.view_as_complex(x.contiguous().view(*x.shape[:-1], -1, 2)) * turn).flatten(-2)
    want_q = rotate(q.reshape(B, H, hd)[:, :, nope:], rope.unsqueeze(1))
    lat = kv[:, :R]
    want_new = torch.cat([lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * w, rotate(kv[:, R:], rope)], 1)
    torch.testing.assert_close(q_rope, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new, want_new, rtol=1e-5, atol=1e-5)


def rope_table(n_pos: int, head_dim: int, device: str, rotated: int) -> torch.Tensor:
    """[n_pos, head_dim / 2] complex64 turns at random angles of a head's first `rotated` values,
    the pairs past them (partial rotary) exactly 1, as the models' tables hold them."""
    angles = torch.rand(n_pos, rotated // 2, dtype=torch.float64) * 6.3
    turned = torch.polar(torch.ones_like(angles), angles)
    still = torch.ones(n_pos, head_dim // 2 - angles.shape[1], dtype=turned.dtype)
    return torch.cat([turned, still], dim=1).to(torch.complex64).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotated", [None, 0, 64, 48],
                         ids=["turned-first", "turns-of-one", "turned-whole", "turned-partly"])
@pytest.mark.parametrize("pieces", [None, 1], ids=["pieces-cover", "one-piece-a-row"])
def test_attention_rows_of_one_cache_with_store_first_are_its_causal_prefill(device, dtype, rotated, pieces):
    """Rows at consecutive positions of one cache, keys and values stored before any row
    attends: row i sees the cache's past and rows 0..i, as torch's row-by-row reference does.
    With a rope table the kernels turn the queries and keys themselves (`rotated`: how many of a
    head's values turn; 0: none, the reference's table is all ones), as torch's complex product
    does up to a last bit (the stored keys to one unit of the cache's precision).  `pieces`: a
    workspace capped to that many pieces a row, each row's positions in one stretched piece."""
    if not usable(device, dtype):
        pytest.skip("no bfloat16 in Triton's interpreter")
    torch.manual_seed(1)
    H, Hkv, D, n_ctx, n_layer, start, T = 9, 3, 64, 300, 2, 37, 50
    cache = torch.randn(n_layer, 2, Hkv, n_ctx, D, device=device).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=device)
    rows = torch.tensor([[0, start + i, 0, cache.stride(0), cache.stride(1), cache.stride(2)] for i in range(T)],
                        device=device)
    work = ca.Workspace(T, H, D, n_ctx, Hkv, torch.device(device),
                        max_programs=None if pieces is None else T * Hkv * pieces)
    assert work.stretch == (pieces is not None)
    table = None if rotated is None else rope_table(n_ctx, D, device, rotated)
    turns = None if table is None else ca.rope_pairs(table)
    expect = cache.clone()
    for layer in range(n_layer):
        got = ca.decode_attention(qkv, rows, layer, cache, work, H, Hkv, D, store_first=True, rope=turns).clone()
        want = ca.reference_attention(qkv, [expect[layer]] * T, list(range(start, start + T)), H, Hkv, D, table)
        torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if rotated:
        torch.testing.assert_close(cache, expect, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        assert torch.equal(cache[:, :, :, :start], expect[:, :, :, :start])  # nothing before the rows moved
        assert torch.equal(cache[:, :, :, start + T:], expect[:, :, :, start + T:])
    else:
        assert torch.equal(cache, expect)  # no turn (or turns of exactly 1): the same bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotated", [None, 64], ids=["turned-first", "turned-whole"])
@pytest.mark.parametrize("pieces", [None, 2], ids=["pieces-cover", "two-pieces-a-row"])
@pytest.mark.parametrize("block", [32, 64], ids=["blocks-of-32", "blocks-of-64"])
def test_attention_rows_that_store_their_own_keys(device, dtype, rotated, pieces, block, monkeypatch):
    """Decoding rows of pool slots and standalone caches, each storing its own key and value
    (a graph's decoding step): torch's reference at positions within a piece, at a piece's last
    and next positions, and a first token; the piece reads started before the kernel's wait
    (`EARLY_CACHE_READS`) give the same bits as reads in the loop, outputs and caches.  With
    `pieces`, the workspace launches two pieces a row: rows past 128 positions stretch theirs
    (to 128 positions at 199, 192 at 290: the new position in the second piece, or the first).
    The pieces read `block` positions an inner iteration (BLOCKS)."""
    if not usable(device, dtype):
        pytest.skip("no bfloat16 in Triton's interpreter")
    torch.manual_seed(2)
    H, Hkv, D, n_layer, n_ctx = 9, 3, 64, 2, 300
    pool = torch.randn(n_layer, 2, 4, Hkv, 320, D, device=device).to(dtype)
    solo = torch.randn(n_layer, 2, Hkv, 200, D, device=device).to(dtype)
    fresh = [pool.clone(), solo.clone()]
    pos = [5, 63, 64, 199, 0, 290]
    qkv = torch.randn(len(pos), (H + 2 * Hkv) * D, device=device)
    table = None if rotated is None else rope_table(n_ctx, D, device, rotated)
    turns = None if table is None else ca.rope_pairs(table)
    results = {}
    monkeypatch.setattr(ca, "BLOCKS", (block, block))
    for early in (False, True):
        pool.copy_(fresh[0])
        solo.copy_(fresh[1])
        caches = [pool[:, :, 2], pool[:, :, 1], solo, pool[:, :, 0], solo.new_zeros(n_layer, 2, Hkv, 1, D),
                  pool[:, :, 3]]
        rows = torch.tensor([[0, p, (c.data_ptr() - solo.data_ptr()) // c.element_size(), c.stride(0), c.stride(1),
                              c.stride(2)] for c, p in zip(caches, pos)], device=device)
        work = ca.Workspace(len(pos), H, D, n_ctx, Hkv, torch.device(device),
                            max_programs=None if pieces is None else len(pos) * Hkv * pieces)
        assert (work.split, work.block) == (64, block)  # pieces of 64: 63 and 64 end one, begin the next
        assert (work.n_split, work.stretch) == ((5, False) if pieces is None else (2, True))
        monkeypatch.setattr(ca, "EARLY_CACHE_READS", early)
        expect = [c.clone() for c in caches]
        outs = []
        for layer in range(n_layer):
            outs.append(ca.decode_attention(qkv, rows, layer, solo, work, H, Hkv, D, rope=turns).clone())
            want = ca.reference_attention(qkv, [e[layer] for e in expect], pos, H, Hkv, D, table)
            torch.testing.assert_close(outs[-1], want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        for c, e in zip(caches, expect):
            torch.testing.assert_close(c, e, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        results[early] = outs, [c.clone() for c in caches]
    for a, b in zip(results[False][0] + results[False][1], results[True][0] + results[True][1]):
        assert torch.equal(a, b)


def test_rope_must_be_a_float32_table_of_the_head_width():
    qkv, rows = torch.zeros(1, 5 * 8), torch.zeros(1, ca.ROW_FIELDS, dtype=torch.int64)
    cache = torch.zeros(1, 2, 1, 4, 8)
    work = ca.Workspace(1, 3, 8, 4, 1, torch.device("cpu"))
    table = rope_table(4, 8, "cpu", 8)
    for bad in (torch.view_as_real(table).flatten(1).double(), torch.view_as_real(table)[:, :2].flatten(1),
                torch.view_as_real(table).flatten(1).t().contiguous().t()):
        with pytest.raises(ValueError, match="rope must be"):
            ca.decode_attention(qkv, rows, 0, cache, work, 3, 1, 8, rope=bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32-rows", "float16-rows", "bfloat16-rows"])
@pytest.mark.parametrize("rotated", [None, 64, 48], ids=["unturned", "turned-whole", "turned-partly"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 64), (4, 4, 48)], ids=["9-3-64", "32-8-64", "4-4-48"])
def test_prefill_inputs_are_the_models_torch_ops(device, dtype, source, rotated, shape):
    """A prefill chunk's queries, keys and values from its projections in one kernel: the same
    values as engine.models.llama's torch ops (the projections made float32, turned by torch's
    complex product, the keys and values stored into the cache and the queries rounded to its
    dtype), with no cache position outside the chunk's written.  Head counts that fill the
    kernel's head blocks and ones that do not; a head width that is not a power of two."""
    if not usable(device, dtype) or not usable(device, source):
        pytest.skip("no bfloat16 in Triton's interpreter")
    if rotated is not None and rotated > shape[2]:
        pytest.skip("no more turned values than a head has")
    torch.manual_seed(3)
    H, Hkv, D = shape
    n_ctx, start, T = 120, 37, 50
    kv = torch.randn(2, Hkv, n_ctx, D, device=device).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, device=device).to(source)
    table = None if rotated is None else rope_table(n_ctx, D, device, rotated)
    want_kv = kv.clone()
    rows = qkv.to(torch.float32, copy=True)
    if table is not None:
        torch.view_as_complex(rows.view(T, -1, D // 2, 2))[:, : H + Hkv].mul_(table[start: start + T].unsqueeze(1))
    want_kv[:, :, start: start + T] = rows[:, H * D:].view(T, 2, Hkv, D).permute(1, 2, 0, 3)
    want_q = rows[:, : H * D].view(T, H, D).to(dtype)
    q = ca.prefill_inputs(qkv, kv, start, H, Hkv, D, None if table is None else ca.rope_pairs(table))
    assert q.shape == (T, H, D) and q.dtype == dtype
    exact = rotated is None or INTERPRETED  # on a GPU a fused multiply-add may move a turned value's last bit
    tolerance = {} if not exact else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(q, want_q, **tolerance)
    torch.testing.assert_close(kv, want_kv, **tolerance)
    assert torch.equal(kv[:, :, :start], want_kv[:, :, :start])
    assert torch.equal(kv[:, :, start + T:], want_kv[:, :, start + T:])


def test_prefill_inputs_refuse_what_does_not_fit():
    kv = torch.zeros(2, 1, 8, 16)
    qkv = torch.zeros(4, 5 * 16)
    for bad_qkv, bad_kv, start in ((torch.zeros(4, 4 * 16), kv, 0), (qkv, torch.zeros(2, 2, 8, 16), 0),
                                   (qkv, kv, 5), (qkv.t().contiguous().t(), kv, 0)):
        with pytest.raises(ValueError, match="must be|do not fit"):
            ca.prefill_inputs(bad_qkv, bad_kv, start, 3, 1, 16)
    with pytest.raises(ValueError, match="rope must be"):
        ca.prefill_inputs(qkv, kv, 0, 3, 1, 16, rope=torch.zeros(3, 16))
