"""engine.cuda_moe's stacked experts against a float64 reference written from the stack's
matrices: the indexed one-row products and the grouped GEMM (with its grouping of (row, slot)
pairs by expert on the device), int4, int8 and bfloat16 stacks, the sum into the residual
stream, wide and narrow batches against rows alone; the stacks against the file's weights and
their bookkeeping; the routing kernels against the families' torch rules; and the qwen_moe and
deepseek2 model code of that path against their float64 references (interpreter only: on a
device tests/engine/test_qwen_moe.py and test_deepseek2.py cover it).

The kernels run on a CUDA device (gpu-marked) or, where none is present, under Triton's
interpreter on CPU tensors when the process was started with TRITON_INTERPRET=1 (Triton reads
it when the kernels are defined); else those tests are skipped, as they are without Triton.
The interpreter rounds float32 to bfloat16 by truncation and multiplies bfloat16 tensor-core
operands wrongly, so there the kernels take float32 operands and the inputs are bfloat16 values
already: that checks every index, mask, grouping and sum, and the device checks the rounding.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from engine import cuda_int4, cuda_moe
from engine.cuda_attention import dependent_launch_capable
from engine.models import deepseek2, qwen_moe
from engine.gguf_file import TensorRecord
from engine.quants import unpack_int4_groups
from engine.synthetic import RANDOM_BLOCKS, random_blocks
from engine.weights import split_experts, to_float

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# gate products of the random Q6_K blocks overflow exp(-g) to infinity, which SiLU takes (to -0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or not cuda_moe.AVAILABLE, reason="needs a CUDA device and Triton")]),
           pytest.param("cpu", marks=pytest.mark.skipif(
               not (INTERPRETED and cuda_moe.AVAILABLE), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"))]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setattr(cuda_moe, "OPERAND", cuda_moe.tl.float32)
    return torch.device(request.param)


def record(name: str, w: np.ndarray, qtype: QT) -> TensorRecord:
    """w in `qtype`; types gguf cannot quantize get random blocks of w's shape instead."""
    if qtype in RANDOM_BLOCKS:
        data = random_blocks(qtype, w.size // w.shape[-1], w.shape[-1], np.random.default_rng(w.size))
    else:
        data = w.astype(np.float32) if qtype == QT.F32 else gq.quantize(w.astype(np.float32), qtype)
    return TensorRecord(name, qtype, w.shape, np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def expert_records(n_expert: int, n_embd: int, n_ff: int, qtype: QT, seed: int = 0) -> list[TensorRecord]:
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((n_expert, n_ff, n_embd)) * n_embd ** -0.5 for _ in range(2))
    down = rng.standard_normal((n_expert, n_embd, n_ff)) * n_ff ** -0.5
    return [record("ffn_gate_exps", gate, qtype), record("ffn_up_exps", up, qtype),
            record("ffn_down_exps", down, qtype)]


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a).float().to(torch.bfloat16).double().numpy()


def reference(experts: cuda_moe.StackedExperts, h: np.ndarray, ids: np.ndarray, weights: np.ndarray,
              rounds: bool) -> np.ndarray:
    """float64: each row's sum over its slots, in order, of weight * down(silu(gate) * up) of the
    slot's expert, with the matrices the stack holds (`dequantized`, which
    test_stacks_hold_the_files_weights holds to the file), the activations (and the gate/up
    product) rounded to bfloat16 where the kernels round them."""
    gate_up, down = (w.dequantized().double().cpu().numpy() for w in (experts.gate_up, experts.down))
    f = experts.n_ff
    x = bf16(h) if rounds else h.astype(np.float64)
    out = np.zeros((h.shape[0], experts.n_embd))
    for t, (row, w) in enumerate(zip(ids, weights)):
        for e, wt in zip(row, w):
            gu = gate_up[e] @ x[t]
            g, u = gu[:f], gu[f:]
            a = g / (1 + np.exp(-g)) * u
            out[t] += wt * (down[e] @ (bf16(a) if rounds else a))
    return out


def routing(rows: int, n_expert: int, k: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(rows)])
    return ids, rng.random((rows, k)).astype(np.float32)


def run(experts: cuda_moe.StackedExperts, h: np.ndarray, ids: np.ndarray, weights: np.ndarray,
        device: torch.device, into: np.ndarray | None = None) -> np.ndarray:
    args = (torch.from_numpy(h).to(device), torch.from_numpy(ids).to(device), torch.from_numpy(weights).to(device))
    if into is None:
        return experts(*args).double().cpu().numpy()
    out = torch.from_numpy(into.copy()).to(device)
    assert experts(*args, into=out) is out
    return out.double().cpu().numpy()


def inputs(rows: int, n_embd: int, device: torch.device, seed: int = 2) -> np.ndarray:
    h = np.random.default_rng(seed).standard_normal((rows, n_embd)).astype(np.float32)
    return h if device.type == "cuda" else bf16(h).astype(np.float32)  # see the module docstring


# Rows on both sides of GEMV_MAX_ROWS: the indexed products and the grouped GEMM.
ROWS = [1, 3, cuda_moe.GEMV_MAX_ROWS + 1, 40]


# Each format of a stack: int4 (Q4_*), int8 in groups of 32 (Q8_0, Q5_0) and 16 (Q6_K), bfloat16.
FORMAT_OF = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8", "Q5_0": "int8", "Q6_K": "int8",
             "F16": "bf16"}


@pytest.mark.parametrize("qtype", list(FORMAT_OF))
@pytest.mark.parametrize("rows", ROWS)
def test_experts_match_the_float64_reference(device, qtype, rows):
    E, d, f, k = 8, 64, 64, 2
    if qtype.endswith("_K"):  # whole super-blocks of 256 inputs
        d = f = 256
    recs = expert_records(E, d, f, QT[qtype])
    experts = cuda_moe.StackedExperts.build(*recs, device)
    assert experts.gate_up.format == experts.down.format == FORMAT_OF[qtype]
    h = inputs(rows, d, device)
    ids, w = routing(rows, E, k)
    want = reference(experts, h, ids, w, rounds=device.type == "cuda")
    got = run(experts, h, ids, w, device)
    scale = np.abs(want).max()
    # float32 sums in another order, and a bfloat16 rounding of gate/up's output that may fall
    # on the other side of a tie
    assert np.abs(got - want).max() <= 2e-3 * scale
    residual = np.random.default_rng(3).standard_normal(want.shape).astype(np.float32)
    added = run(experts, h, ids, w, device, into=residual)
    assert np.abs(added - (residual + got)).max() <= 1e-6 * np.abs(added).max()


@pytest.mark.parametrize("k", [1, 6])
def test_many_experts_few_used_and_a_stride(device, k):
    """64 experts, k of them per row (DeepSeek-V2-Lite's 6), rows that repeat an expert, and h a
    strided view."""
    E, d, f, rows = 64, 64, 96, 20
    recs = expert_records(E, d, f, QT.Q4_0, seed=5)
    experts = cuda_moe.StackedExperts.build(*recs, device)
    wide = inputs(rows, 2 * d, device)
    h = wide[:, :d]
    ids, w = routing(rows, E, k, seed=6)
    ids[1] = ids[0]  # two rows on the same experts
    want = reference(experts, np.ascontiguousarray(h), ids, w, rounds=device.type == "cuda")
    got = run(experts, h, ids, w, device)  # run copies h, so pass the view through torch as a view
    view = torch.from_numpy(wide).to(device)[:, :d]
    strided = experts(view, torch.from_numpy(ids).to(device), torch.from_numpy(w).to(device))
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert torch.equal(strided.cpu(), torch.from_numpy(got).float())


def test_a_row_in_a_batch_equals_the_row_alone_within_the_bound(device):
    """Rows alone take the indexed products; the same rows in a wide batch the grouped GEMM:
    the same values up to the order of float32 sums.  Within one shape, a row's result does
    not depend on the other rows (the indexed products bit for bit)."""
    E, d, f, k, rows = 8, 64, 64, 2, 24
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT.Q4_0), device)
    h = inputs(rows, d, device)
    ids, w = routing(rows, E, k)
    batch = run(experts, h, ids, w, device)
    alone = np.concatenate([run(experts, h[i: i + 1], ids[i: i + 1], w[i: i + 1], device) for i in range(rows)])
    assert np.abs(batch - alone).max() <= 1e-3 * np.abs(alone).max()
    half = rows // 2  # still the grouped GEMM, other rows beside them (in other places of a block)
    part = run(experts, h[half:], ids[half:], w[half:], device)
    # a tile's rows are independent dot products; the bound only allows for the compiler
    # specialising the kernel on the pair count
    assert np.abs(part - batch[half:]).max() <= 1e-6 * np.abs(batch).max()
    few = run(experts, h[:3], ids[:3], w[:3], device)
    np.testing.assert_array_equal(few[1:], run(experts, h[1:3], ids[1:3], w[1:3], device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not cuda_moe.AVAILABLE
                    or not dependent_launch_capable(torch.device("cuda")),
                    reason="needs a CUDA device of compute capability 9.0 or more and a Triton with dependent launches")
@pytest.mark.parametrize("rows", [3, cuda_moe.GEMV_MAX_ROWS + 32])  # the indexed products, the grouped GEMM
@pytest.mark.parametrize("rule", ["softmax", "grouped"])
def test_kernels_launched_as_dependents_give_the_same_bits(monkeypatch, rows, rule):
    """Routing and experts that start while the kernel before them runs (DEPENDENT_EXPERT_ROWS) give
    the bits of ones launched after it: a norm, the router's int4 product, the routing kernel,
    the experts added into the residual and a stack's per-matrix products, one after another,
    captured in a CUDA graph as decoding steps are, and run eagerly."""
    from engine import cuda_elementwise
    from graph_replay import replayed_and_eager
    cuda = torch.device("cuda")
    E, d, f, k = 16, 128, 192, 4
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT.Q4_0, seed=21), cuda)
    stack = experts.down  # E matrices [d, f]
    rng = np.random.default_rng(22)
    scale = (rng.random((E, d // 32)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    router = cuda_int4.Int4Weight(rng.integers(0, 16, size=(E, d), dtype=np.uint8), scale, -8 * scale, cuda)
    h = torch.randn(rows, d, device=cuda)
    norm_weight = torch.rand(d, device=cuda) + 0.5
    per_matrix = torch.randn(rows, E, f, device=cuda)
    residual = torch.randn(rows, d, device=cuda)
    out = {}
    for dependent in (False, True):
        monkeypatch.setattr(cuda_moe, "DEPENDENT_EXPERT_ROWS", rows if dependent else 0)

        def step():
            x = cuda_elementwise.rms_norm(h, norm_weight, 1e-5, torch.float32)
            scores = router(x)
            if rule == "softmax":
                ids, weights = cuda_moe.route_softmax(scores, k, renormalise=True)
            else:
                ids, weights = cuda_moe.route_grouped(scores, k, "sigmoid", n_groups=4, n_groups_used=2,
                                                      normalise=True, scale=2.5)
            into = residual.clone()
            experts(x, ids, weights, into=into)
            return into, cuda_moe.matrix_products(per_matrix * into[:, None, :1], stack)
        out[dependent] = replayed_and_eager(step, h)
    for a, b in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
        assert torch.equal(a, b)
    for a, b in zip(*out[True]):
        assert torch.equal(a, b)


# The few-row launch shapes (engine.cuda_moe.MoeLaunch): the down product a program per row or
# per (row, slot) pair, each weight load a step early or not.
FEW_ROW_SHAPES = [dict(gemv_down=d, gemv_prefetch=p) for d in cuda_moe.DOWN_SHAPES for p in (False, True)]
FEW_ROW_IDS = [f"{s['gemv_down']}{'-prefetch' if s['gemv_prefetch'] else ''}" for s in FEW_ROW_SHAPES]


@pytest.mark.parametrize("shape", FEW_ROW_SHAPES, ids=FEW_ROW_IDS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])  # int4, int8, bfloat16 stacks
def test_few_row_launch_shapes(device, shape, qtype):
    """Each shape against the float64 reference, alone and added into the residual, with
    column tiles past the matrices' edges (64-wide tiles of 96 and 160 columns) and a masked
    loop step (5 groups in steps of 8); each row of a few equals the row alone, bit for bit;
    prefetching the next step's weights gives the same bits as not."""
    E, d, f, k, rows = 16, 96, 160, 6, 3
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT[qtype], seed=7), device)
    experts.launch = dataclasses.replace(cuda_moe.LAUNCH, gemv_bn=64, gemv_gb=8, **shape)
    h = inputs(rows, d, device, seed=8)
    ids, w = routing(rows, E, k, seed=9)
    want = reference(experts, h, ids, w, rounds=device.type == "cuda")
    got = run(experts, h, ids, w, device)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    residual = np.random.default_rng(10).standard_normal(want.shape).astype(np.float32)
    added = run(experts, h, ids, w, device, into=residual)
    assert np.abs(added - (residual + got)).max() <= 1e-6 * np.abs(added).max()
    for i in range(rows):
        np.testing.assert_array_equal(got[i], run(experts, h[i: i + 1], ids[i: i + 1], w[i: i + 1], device)[0])
    if shape["gemv_prefetch"]:
        experts.launch = dataclasses.replace(experts.launch, gemv_prefetch=False)
        np.testing.assert_array_equal(got, run(experts, h, ids, w, device))


@pytest.mark.parametrize("unroll", [2, 4])
def test_grouped_gemm_unrolled(device, unroll):
    """The grouped GEMM (more than GEMV_MAX_ROWS rows) with groups unrolled per loop step: 4
    groups of gate/up and 6 of down (unrolled by 2 where 4 does not divide them), against the
    float64 reference and the loop of one group a step."""
    E, d, f, k, rows = 8, 128, 192, 2, cuda_moe.GEMV_MAX_ROWS + 4
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT.Q4_0, seed=13), device)
    h = inputs(rows, d, device, seed=14)
    ids, w = routing(rows, E, k, seed=15)
    plain = run(experts, h, ids, w, device)
    experts.launch = dataclasses.replace(cuda_moe.LAUNCH, gemm_unroll=unroll)
    got = run(experts, h, ids, w, device)
    want = reference(experts, h, ids, w, rounds=device.type == "cuda")
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert np.abs(got - plain).max() <= 1e-6 * np.abs(plain).max()  # the same sums in the same order


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q8_0"])  # int4 (groups of 32 both), int8
def test_grouped_gemm_reading_narrow_inputs_gives_the_same_bits(device, qtype):
    """`MoeLaunch.gemm_narrow_act` (the SwiGLU's activations stored as the operand type the down
    product rounds them to) and `gemm_narrow_input` (the input rounded so before the gate/up
    product), each and both: the same sums in the same order as over float32 inputs, bit for
    bit, the residual added too, and the float64 reference."""
    E, d, f, k, rows = 8, 256, 256, 2, cuda_moe.GEMV_MAX_ROWS + 9
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT[qtype], seed=20), device)
    h = inputs(rows, d, device, seed=21)
    ids, w = routing(rows, E, k, seed=22)
    residual = np.random.default_rng(23).standard_normal((rows, d)).astype(np.float32)
    switches = {"wide": (False, False), "act": (True, False), "input": (False, True), "both": (True, True)}
    got = {}
    for name, (act, inp) in switches.items():
        experts.launch = dataclasses.replace(cuda_moe.LAUNCH, gemm_narrow_act=act, gemm_narrow_input=inp)
        got[name] = run(experts, h, ids, w, device), run(experts, h, ids, w, device, into=residual)
    for name in ("act", "input", "both"):
        np.testing.assert_array_equal(got[name][0], got["wide"][0])
        np.testing.assert_array_equal(got[name][1], got["wide"][1])
    want = reference(experts, h, ids, w, rounds=device.type == "cuda")
    assert np.abs(got["both"][0] - want).max() <= 2e-3 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K", "F16"])  # int4, int8 (groups of 32, 16), bfloat16
@pytest.mark.parametrize("n_expert", [8, 2])  # blocks of 16 pairs (decoding batches) and of 64 (prefill)
def test_grouped_gemm_in_both_tile_orders(device, qtype, n_expert):
    """The grouped GEMM's tiles computed rows by columns and transposed (MoeLaunch.
    gemm_transposed_bm), with a column tile past the matrices' edge: both against the float64
    reference, and each other up to the order of float32 sums."""
    E, d, f, k, rows = n_expert, 64, 96, 2, 40
    if qtype.endswith("_K"):
        d, f = 256, 256
    experts = cuda_moe.StackedExperts.build(*expert_records(E, d, f, QT[qtype], seed=16), device)
    assert cuda_moe.block_m(rows * k, E) == (16 if E == 8 else 64)
    h = inputs(rows, d, device, seed=17)
    ids, w = routing(rows, E, k, seed=18)
    want = reference(experts, h, ids, w, rounds=device.type == "cuda")
    got = {}
    for transposed_bm in (0, 64):
        experts.launch = dataclasses.replace(cuda_moe.LAUNCH, gemm_bn=64, gemm_transposed_bm=transposed_bm)
        got[transposed_bm] = run(experts, h, ids, w, device)
        assert np.abs(got[transposed_bm] - want).max() <= 2e-3 * np.abs(want).max()
    assert np.abs(got[0] - got[64]).max() <= 1e-5 * np.abs(want).max()
    residual = np.random.default_rng(19).standard_normal(want.shape).astype(np.float32)
    added = run(experts, h, ids, w, device, into=residual)
    assert np.abs(added - (residual + got[64])).max() <= 1e-6 * np.abs(added).max()


def test_launch_refuses_an_unknown_down_shape():
    with pytest.raises(ValueError, match="gemv_down"):
        cuda_moe.MoeLaunch(gemv_down="columns")


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3])
def test_matrix_products_of_a_stack(device, qtype, rows):
    """Each row's input e through matrix e (deepseek2's per-head W_k and W_v): against float64
    products of the stack's matrices, from strided inputs, into a strided output; each row
    equals the row alone, and the launch prefetching weights the one that does not, bit for
    bit."""
    E, n, k = 4, 48, 256
    w = np.random.default_rng(11).standard_normal((E, n, k)) * k ** -0.5
    stack = cuda_moe.StackedWeight([record("attn_k_b", w, QT[qtype])], device)
    assert stack.format == ("int4" if qtype == "Q4_K" else "int8")
    wide = inputs(rows * E, 2 * k, device, seed=12).reshape(rows, E, 2 * k)
    x = torch.from_numpy(wide).to(device)[:, :, k:]  # inputs strided by 2k
    mats = stack.dequantized().double().cpu().numpy()
    xs = x.double().cpu().numpy()
    want = np.einsum("enk,tek->ten", mats, bf16(xs) if device.type == "cuda" else xs)
    got = cuda_moe.matrix_products(x, stack)
    assert got.shape == (rows, E, n) and got.dtype == torch.float32
    assert np.abs(got.double().cpu().numpy() - want).max() <= 1e-5 * np.abs(want).max()
    held = torch.zeros(E, rows, n + 8, device=device)
    into = held[:, :, :n].transpose(0, 1)  # [rows, E, n], rows and matrices strided
    assert cuda_moe.matrix_products(x, stack, out=into) is into
    assert torch.equal(into, got) and not held[:, :, n:].any()
    for t in range(rows):
        assert torch.equal(cuda_moe.matrix_products(x[t: t + 1], stack)[0], got[t])
    early = dataclasses.replace(cuda_moe.LAUNCH, gemv_prefetch=True, gemv_gb=4)  # 8 groups in two steps
    assert torch.equal(cuda_moe.matrix_products(x, stack, launch=early),
                       cuda_moe.matrix_products(x, stack, launch=dataclasses.replace(early, gemv_prefetch=False)))
    with pytest.raises(ValueError, match="stack of 4 matrices"):
        cuda_moe.matrix_products(x[:, :3], stack)


@pytest.mark.parametrize("n_expert,k,renormalise", [(8, 2, True), (128, 8, True), (60, 4, False), (4, 4, True)])
def test_routing_kernel_follows_the_torch_rule(device, n_expert, k, renormalise):
    """route_softmax against engine.models.qwen_moe.route: the same experts in the same order (a
    tie to the lower index), the same weights up to float32 sums; strided score rows."""
    g = torch.Generator().manual_seed(n_expert)
    scores = torch.randn(6, n_expert + 1, generator=g) * 3
    scores[0, 1] = scores[0, 3] = 10.0
    ids, weights = cuda_moe.route_softmax(scores.to(device)[:, :n_expert], k, renormalise)
    want_ids, want = qwen_moe.route(scores[:, :n_expert], k, renormalise)
    assert ids.is_contiguous() and weights.is_contiguous() and ids[0, :2].tolist() == [1, 3]
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want, rtol=1e-5, atol=1e-6)  # exp approximated on the device


@pytest.mark.parametrize("rule", [
    dict(n_expert=8, k=2, gating="softmax"),
    dict(n_expert=64, k=6, gating="softmax"),  # DeepSeek-V2-Lite
    dict(n_expert=160, k=6, gating="softmax", n_groups=8, n_groups_used=3),  # DeepSeek-V2: groups, not a power of two
    dict(n_expert=256, k=8, gating="sigmoid", bias=True, n_groups=8, n_groups_used=4, normalise=True, scale=2.5),  # V3
    dict(n_expert=12, k=3, gating="sigmoid", bias=True, n_groups=3, n_groups_used=1),
], ids=["v2-lite-like", "v2-lite", "v2", "v3", "odd"])
def test_grouped_routing_kernel_follows_the_torch_rule(device, rule):
    """route_grouped against engine.models.deepseek2.route: the same experts in the same order
    (a tie to the lower index), the same weights up to float32 sums."""
    rule = dict(rule)
    E, k, gating = rule.pop("n_expert"), rule.pop("k"), rule.pop("gating")
    g = torch.Generator().manual_seed(E)
    scores = torch.randn(6, E, generator=g) * 3
    scores[0, 1] = scores[0, 3] = 10.0
    bias = 0.3 * torch.randn(E, generator=g) if rule.pop("bias", False) else None
    ids, weights = cuda_moe.route_grouped(scores.to(device), k, gating, None if bias is None else bias.to(device),
                                          min_sum=deepseek2.MIN_WEIGHT_SUM, **rule)
    want_ids, want = deepseek2.route(scores, k, gating, bias, **rule)
    assert ids.is_contiguous() and weights.is_contiguous()
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want, rtol=1e-5, atol=1e-6)


def test_pairs_are_grouped_by_expert_in_whole_blocks(device, monkeypatch):
    rng = np.random.default_rng(4)
    E, P, bm = 16, 300, 16
    ids = torch.from_numpy(rng.integers(0, E, P)).to(device)
    ids[:40] = 3  # one expert with several blocks
    monkeypatch.setattr(cuda_moe, "ALIGN_ELEMENTS", 64 * E)  # the pairs in five chunks
    n_blocks = cuda_moe.max_blocks(P, E, bm)
    # freed memory of the output's size holding other numbers: every slot must be written
    torch.full((n_blocks * bm,), 7, dtype=torch.int32, device=device)
    pairs, owner = cuda_moe.group_by_expert(ids, E, bm)
    assert owner.shape == (n_blocks,) and pairs.shape == (n_blocks * bm,)
    assert ((pairs >= 0) & (pairs <= P)).all().item() and (pairs == P).sum().item() == n_blocks * bm - P
    pairs, owner, ids = pairs.cpu().view(n_blocks, bm), owner.cpu(), ids.cpu()
    seen = []
    for b in range(n_blocks):
        real = pairs[b][pairs[b] < P]
        if owner[b] < 0:
            assert len(real) == 0
            continue
        assert (ids[real.long()] == owner[b]).all()
        seen.extend(real.tolist())
    assert sorted(seen) == list(range(P)) and len(seen) == P  # every pair exactly once
    used = owner[owner >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in order, then the unused blocks
    assert (owner[len(used):] == -1).all()
    counts = torch.bincount(ids, minlength=E)
    assert len(used) == int(((counts + bm - 1) // bm).sum())
    assert seen == sorted(seen, key=lambda p: (int(ids[p]), p))  # within an expert, pair order


def test_block_sizes_and_the_grid_bound():
    assert cuda_moe.block_m(32 * 8, 128) == 16 and cuda_moe.block_m(512 * 8, 128) == 32
    assert cuda_moe.block_m(2048 * 8, 64) == 64
    rng = np.random.default_rng(0)
    for P, E, bm in ((8, 128, 16), (256, 128, 16), (4096, 64, 64), (300, 16, 16)):
        for _ in range(20):
            counts = np.bincount(rng.integers(0, rng.integers(1, E + 1), P), minlength=E)
            assert (-(-counts // bm)).sum() <= cuda_moe.max_blocks(P, E, bm)


def test_stacks_refuse_mismatched_shapes():
    gate, up, down = expert_records(4, 64, 64, QT.F32)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="do not make one SwiGLU"):  # gate without up
        cuda_moe.StackedExperts(cuda_moe.StackedWeight([gate], cpu), cuda_moe.StackedWeight([down], cpu))
    other = expert_records(4, 96, 64, QT.F32)[0]  # another input width
    with pytest.raises(ValueError, match="cannot stack"):
        cuda_moe.StackedWeight([gate, other], cpu)


def test_packed_stacks_hold_the_int4_layout():
    """The nibbles and (scale, minimum) pairs of each expert are engine.cuda_int4's, and the
    bytes are counted."""
    recs = expert_records(4, 64, 64, QT.Q4_1)
    experts = cuda_moe.StackedExperts.build(*recs, torch.device("cpu"))
    gu = experts.gate_up
    assert gu.nibbles.shape == (4, 128, 32) and gu.pairs.shape == (4, 2, 128, 2) and gu.pairs.dtype == torch.float16
    g, u = split_experts(recs[0])[2], split_experts(recs[1])[2]
    parts = [unpack_int4_groups(r.qtype, r.data, r.n_cols) for r in (g, u)]
    q = np.concatenate([p.q for p in parts]).astype(np.uint8)
    np.testing.assert_array_equal(gu.nibbles[2].numpy(), (q[:, ::2] << 4) | q[:, 1::2])
    pairs = cuda_int4.scale_pairs(*(torch.from_numpy(np.concatenate([getattr(p, f) for p in parts]))
                                    for f in ("scale", "minimum")))
    assert torch.equal(gu.pairs[2], pairs)
    assert experts.nbytes == sum(t.nbytes for t in (gu.nibbles, gu.pairs, experts.down.nibbles, experts.down.pairs))


@pytest.mark.parametrize("qtypes", [("Q4_0",), ("Q4_1",), ("Q8_0",), ("Q5_0",), ("Q5_1",), ("Q4_K",), ("Q6_K",),
                                    ("F16",), ("Q6_K", "Q4_K"), ("Q8_0", "Q4_0")])
def test_stacks_hold_the_files_weights(qtypes):
    """Each expert's matrix as the stack holds it equals the file's dequantized values: exactly
    where the scales are float16 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), to float16's rounding of
    the scale products of the K types, to bfloat16 for F16; gate and up of different types share
    the smaller group."""
    d = f = 256
    rng = np.random.default_rng(0)
    parts = [record(f"part{i}", rng.standard_normal((4, f, d)) * d ** -0.5, QT[t]) for i, t in enumerate(qtypes)]
    parts += [parts[0]] if len(parts) == 1 else []
    stack = cuda_moe.StackedWeight(parts, torch.device("cpu"))
    want = np.concatenate([to_float(r).reshape(4, -1, d) for r in parts], axis=1)
    got = stack.dequantized().double().numpy()
    formats = {FORMAT_OF.get(t, "int8") for t in qtypes}
    assert stack.format == ("int4" if formats == {"int4"} else "bf16" if "bf16" in formats else "int8")
    if stack.format == "int8":
        assert stack.group == (16 if "Q6_K" in qtypes else 32) and stack.q.dtype == torch.int8
    exact = all(t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") for t in qtypes)
    tol = 0 if exact else 2 ** -8 if stack.format == "bf16" else 2 ** -10
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    per_weight = stack.nbytes / (4 * stack.n * d)
    assert per_weight <= {"int4": 0.63, "int8": 1.26, "bf16": 2}[stack.format]


MOE_TOKENS = [5, 77, 130, 2, 250, 9, 9, 41, 200, 13, 66, 101, 3]
# tests/engine/test_qwen_moe.py's seeds whose routing has a clear margin on MOE_TOKENS in Q4_0
QWEN_SEEDS = {"qwen3moe": 7, "qwen2moe": 4}
INTERPRETER_ONLY = pytest.mark.skipif(not (INTERPRETED and cuda_moe.AVAILABLE),
                                      reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture
def stacked_on_cpu(monkeypatch):
    """The families' stacked-experts path (the CUDA one) built on CPU, its kernels interpreted."""
    monkeypatch.setattr(cuda_moe, "OPERAND", cuda_moe.tl.float32)
    monkeypatch.setattr(qwen_moe, "stacks_experts", lambda device, fmt: fmt == "packed")
    monkeypatch.setattr(deepseek2, "stacks_experts", lambda device, fmt: fmt == "packed")  # its per-head stacks


@INTERPRETER_ONLY
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_qwen_moe_through_the_stacked_experts(tmp_path, stacked_on_cpu, arch):
    """The model code of the CUDA path (routing on the device, shared expert, the sum into the
    residual) against the float64 reference, in a prefill chunk and decoding one row."""
    import engine
    from moe_models import MoeSpec, reference_logits, write_random_moe
    path = write_random_moe(tmp_path / "m.gguf", MoeSpec(arch=arch, qtype="Q4_0", seed=QWEN_SEEDS[arch]))
    m = engine.load_model(path)
    assert isinstance(m.net.blocks[0].experts, cuda_moe.StackedExperts)
    ref = reference_logits(path, MOE_TOKENS).logits
    s = m.new_session()
    s.sync(MOE_TOKENS[:-2])
    full = m.net.forward(torch.tensor(MOE_TOKENS), 0, m.new_session().cache, logits="all").double().numpy()
    scale = np.abs(ref).max()
    assert np.abs(full - ref).max() <= 2e-2 * scale
    for t in MOE_TOKENS[-2:]:
        s.eval(t)
    assert np.abs(s.logits.double().numpy() - ref[-1]).max() <= 2e-2 * scale


@INTERPRETER_ONLY
def test_deepseek2_through_the_stacked_experts(tmp_path, stacked_on_cpu):
    """deepseek2's v3-like routing (sigmoid, groups, bias, renormalised and scaled), shared
    experts and the per-head stacks of W_k and W_v through the CUDA path, against the float64
    reference, in a prefill chunk and decoding steps of one row and of three pooled rows."""
    import engine
    from deepseek2_models import DeepSeek2Spec, reference_logits, write_random_deepseek2
    spec = DeepSeek2Spec(qtype="Q4_0", nope=32, q_lora_rank=0, gating="sigmoid", weights_norm=True,
                         weights_scale=2.5, split_kv_b=True, seed=0)
    path = write_random_deepseek2(tmp_path / "d.gguf", spec)
    m = engine.load_model(path)
    assert isinstance(m.net.blocks[1].experts, cuda_moe.StackedExperts) and m.net.blocks[0].dense is not None
    assert all(b.k_stack is not None and b.v_stack is not None for b in m.net.blocks)  # absorbed W_k, W_v
    ref = reference_logits(path, MOE_TOKENS).logits
    scale = np.abs(ref).max()
    full = m.net.forward(torch.tensor(MOE_TOKENS), 0, m.new_session().cache, logits="all").double().numpy()
    assert np.abs(full - ref).max() <= 2e-2 * scale
    # Decoding rows: one alone, then three of a pool in one masked batch (the other devices' way),
    # against the same rows attending alone.
    s = m.new_session()
    s.sync(MOE_TOKENS[:-1])
    s.eval(MOE_TOKENS[-1])
    assert np.abs(s.logits.double().numpy() - ref[-1]).max() <= 2e-2 * scale
    pooled, alone = m.new_sessions(3), m.new_sessions(3)
    for a, b, n in zip(pooled, alone, (3, 6, 9)):
        a.sync(MOE_TOKENS[:n])
        b.sync(MOE_TOKENS[:n])
    want = m.net.forward_rows(torch.tensor([7, 8, 9]), [x.cache for x in alone])
    m.net.rows_alone = False
    got = m.net.forward_rows(torch.tensor([7, 8, 9]), [x.cache for x in pooled])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


