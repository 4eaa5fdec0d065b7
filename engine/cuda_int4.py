"""Int4 matrix products on CUDA: Triton kernels that read the 4-bit weights as they are.

`Int4Weight(q, scale, minimum, device)` holds an N x K matrix of groups of 32 inputs whose
values are q * scale + minimum (Q4_0, Q4_1, Q4_K): the nibbles, two per byte (even input in
the high nibble), and per group and output column the pair (scale, minimum), in float16
where that is exact for every group (Q4_0 and Q4_1, whose GGUF fields are float16) or where
it is finite (Q4_K, whose scales are products of two fields: rounded to 11 bits), else
float32.  `w(x)`: x [M, K] (float32 or bfloat16) -> x @ W^T [M, N] float32; `w(x, into=r)`
adds the product to r (the residual stream) in the product's last kernel instead, up to
`ADD_IN_KERNEL_ROWS` rows: the same one float32 addition, one kernel and one tensor fewer.
`w.paired_halves()` is a [gate; up] matrix with its rows reordered in gate/up pairs, whose
`swiglu(x, dtype)` ends the product in silu(gate) * up (`store_gated`, or the split sums'
kernel), by engine.cuda_elementwise's formula: the bits of the product and then that kernel.

The products never form W.  Per group they multiply the activations, rounded to bfloat16,
by the nibbles as integers: those products are exact and are summed in float32.  Then the
group's scale is applied and minimum * (sum of the group's activations) added, two float32
fused multiply-adds into the output (`add_group`).  That is the arithmetic of the CPU kernels
(engine.kernels), so the CUDA and CPU packed paths round alike.  torch's own int4 kernel
instead keeps scales in bfloat16 and rounds every weight to bfloat16; with it, greedy decoding
of a random 135M-shape model agreed with the CPU float32 path at 98.05% of teacher-forced
positions, against 100% (graph decoding and eager) with these kernels.

One row (`_int4_gemv`, decoding one sequence) runs on the CUDA cores: it reads the nibbles as
int32 words, four to a group, in [columns, words] tiles with a group's words side by side, so
each thread sums whole groups of several columns and rounds, scales and sums each of its
activations once for all of them.  A nibble becomes a float without a conversion instruction (a
quarter of the arithmetic rate on sm_90): its masked bits, read as a float32, are the subnormal
q * 2**(s - 149) for its bit offset s, which meets x * 2**(149 - s - 64), so each product is
exact, times 2**-64, and a group's sum is scaled back (SUBNORMAL_SHIFT).  Launched as a dependent
(`cuda_attention.dependent_launch`, sm_90 on) it reads its first weights before it waits for the
kernel that writes its input.  A few rows of a small matrix (`gemv_rows_for`: rows x n x k up to
GEMV_ROW_ELEMENTS) run as that many one-row products in one launch, each row's sums in its order
alone; more rows run on the tensor cores, one group per product, the nibbles made bfloat16
operands with 2**23 (2**23 + q in float32, less 2**23) instead of an integer conversion.
Decoding steps of up to MAX_BLOCK_M rows compute `_int4_gemm`'s tiles transposed (TRANSPOSED:
columns by rows): the nibbles are then the operand the tensor cores read from registers, and the
activations' group sums come from the tensor cores as well, where the rows-by-columns tiles
(prefill chunks) move the nibbles through shared memory and sum the activations across threads,
a handful of barriers per group.  At 64 rows on an H100 that made the Llama-3.2-1B shape's
products 1.33-1.89x faster and its whole decoding steps 1.25x (docs/measurements.md round 14).
Measured per product (CUDA-graph timings, random matrices of the SmolLM2-135M and
Llama-3.2-1B shapes): on an H100 at one row 1.9-3.4 us on the 135M shape's matrices and
4.2-8.8 us on the 1B shape's (the kernel before round 13 of docs/measurements.md: 2.1-4.5 and
10.1-19.8 us), the 16384 x 2048 matrix at 1.40x the time to read it once; on an H100 at 64
rows, transposed, 6.5-7.2 us on the 135M shape's matrices and 8.7-29.8 us on the 1B shape's
(rows by columns: 6.3-8.9 and 15.4-39.5 us); on an H200 at 2048 rows, on the 135M shape's
matrices, 21-61 us against torch's 57-327 us.  Whole graph-replayed one-row decoding steps on
an H100: dependent launches 1.32x (135M shape) and 1.03x (1B), the [columns, words] tiles 0.99x
and 1.23x.  `launch_for` and `gemv_launch_for` hold the launch shapes the sweeps found fastest.

Few output tiles cannot fill the GPU, so the input axis is split (`split_k`): each split
writes float32 partial sums and one more kernel adds them in a fixed order, so results
never depend on scheduling.  The split follows from the matrix, its number of output tiles
and a cap that keeps the partial sums of many rows small, so a row decoded alone and the
same row in a batch differ only in the order of float32 sums (the tests bound it).

From `gemm_rows` rows on (prefill chunks of large matrices) the matrix is instead written
out as bfloat16 by `_dequantize` into a scratch matrix and multiplied by cuBLAS, which is
faster there although it rounds each weight to bfloat16.  The scratch matrix is shared by
every matrix on a device (one stream runs them one after the other) and only grows; a
buffer it outgrows is kept, because a captured CUDA graph may still write to it.

Without Triton (`AVAILABLE` False) nothing here runs and engine.weights keeps torch's int4
kernel.  It does not choose weight formats (see engine.weights).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine import cuda_elementwise
from engine.cuda_attention import AVAILABLE, dependent_launch, gdc_launch_dependents, gdc_wait, tl, triton

GROUP = 32
BLOCK_N = 64  # output columns per program (default launch)
MAX_BLOCK_M = 64  # rows per program; more rows take more row tiles
ADD_IN_KERNEL_ROWS = MAX_BLOCK_M  # `into` is added by the product's kernel up to this many rows
# A product of rows x n x k up to this many weight elements, times rows, runs as that many one-row
# products in one launch (`gemv`), each row's sums as alone, instead of the tensor-core GEMM, whose
# time hardly grows from 2 to 16 rows.  Whole graph-replayed decoding steps on an H100 with 16 Mi
# against 4 Mi (docs/measurements.md round 16): SmolLM2-135M shape 1.09x at 4 rows, 1.16x at 8 and
# 1.12x at 16; Llama-3.2-1B shape 1.11x at 2 rows, 1.03x at 4, level at 8 and 16; 32 Mi and 64 Mi
# ran slower at 16 rows.
GEMV_ROW_ELEMENTS = 16 * 2 ** 20


# The one-row kernel makes each nibble a float32 without an addition: masked out of its word (from
# bit 20 on, of the word shifted down 12 bits), its bits read as a float32 are the subnormal
# q * 2**(s - 149), s its bit offset there, which meets x * 2**(149 - s - SUBNORMAL_SHIFT): each exact
# product comes out as q * x * 2**-SUBNORMAL_SHIFT, and a group's sum, times 2**SUBNORMAL_SHIFT, is
# the sum itself.  Every sum is then the one of q * 2**s (2**23 OR-ed into the nibble and taken off,
# a float32 addition a weight more, as the tensor-core kernel still does) meeting x * 2**-s, scaled
# by a power of two, so the same bits, as long as no activation reaches 2**(SUBNORMAL_SHIFT - 21) in
# size and no partial sum of a group is smaller than 2**(SUBNORMAL_SHIFT - 126) without being zero
# (it would be subnormal itself): 2**43 and 2**-62.  On an H100 (docs/measurements.md, round 25):
# 18-21% fewer instructions a loop step offline, the 1B shape's one-row steps 1.07x faster.
SUBNORMAL_SHIFT = 64

# The largest matrices (n x k weights) whose tensor-core products are launched as programmatic
# dependents where the one-row kernel is (`cuda_attention.dependent_launch`; 0: none): such a
# launch lets the next kernel launch as it starts and waits for the one before it first, so that
# it overlaps that kernel's end, as the one-row products' and the elementwise kernels' launches
# do.  The same bits.  It pays where the products are short: on an H100 the 135M shape's steps
# (matrices up to 3072 x 576) ran 1.029x faster at 16 rows and 1.078x at 32, and the 1B shape's
# (2048 x 2048 and up) 0.83x at 16 rows and 0.95x at 64 (tests/engine/step_timing.py
# --dependent-gemm; docs/measurements.md, round 26).
DEPENDENT_GEMM_ELEMENTS = 1 << 21


def gemv_rows_for(n: int, k: int) -> int:
    """Most rows an n x k matrix multiplies as one-row products (at least 1)."""
    return max(1, GEMV_ROW_ELEMENTS // (n * k))

# [gate; up] matrices of the SwiGLU families are held in gate/up pairs on CUDA, their products
# ending in the SwiGLU (`Int4Weight.paired_halves`, engine.weights.PairedInt4Linear), instead of
# a product and then the SwiGLU kernel: the same bits, one kernel fewer a layer.
SWIGLU_IN_PRODUCTS = True

# Dequantize + cuBLAS from this many rows on, for matrices of at least GEMM_MIN_ELEMENTS.
GEMM_ROWS = 512
GEMM_MIN_ELEMENTS = 4 * 2 ** 20
NEVER = 1 << 62
MIN_GROUPS_PER_SPLIT = 4


def gemm_rows_for(n: int, k: int) -> int:
    """Fewest rows from which an n x k matrix is dequantized for cuBLAS (NEVER: always fused)."""
    return GEMM_ROWS if n * k >= GEMM_MIN_ELEMENTS else NEVER


def block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else MAX_BLOCK_M


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (1 for CPU tensors, which only Triton's interpreter runs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=4096)  # asked for on every eager product (prefill): a few shapes, many calls
def split_k(n_groups: int, tiles: int, programs: int, max_split: int = 1 << 30) -> int:
    """Splits of the input axis for `tiles` output tiles: about `programs` programs in all,
    each split the same whole number of groups (a divisor of n_groups), at least
    MIN_GROUPS_PER_SPLIT long unless the matrix has fewer groups, and at most `max_split`
    (the float32 partial sums of many rows cost more than they save)."""
    want = max(1, min(programs // max(tiles, 1), max_split))
    fits = [s for s in range(1, n_groups + 1)
            if n_groups % s == 0 and s <= want and n_groups // s >= MIN_GROUPS_PER_SPLIT]
    return max(fits, default=1)


@dataclass(frozen=True)
class Launch:
    """How `_int4_gemm` is launched: its tiles rows by columns or transposed (`transposed`),
    output columns per program, groups unrolled per loop step, warps and pipeline stages per
    program, programs aimed at per multiprocessor (via the split), whether the split is capped
    by the rows' partial sums (`split_cap`: at most K / (16 * rows) splits), and the most
    splits in any case (`max_split`)."""

    bn: int = BLOCK_N
    unroll: int = 4
    warps: int = 4
    stages: int = 3
    waves: int = 8
    split_cap: bool = True
    max_split: int = 1 << 30
    transposed: bool = False


@dataclass(frozen=True)
class GemvLaunch:
    """How `_int4_gemv` (one row) is launched: columns per program, groups per loop step,
    warps, pipeline stages, programs aimed at per multiprocessor, and whether a loop step
    loads the next one's weights before its arithmetic (`gemv_columns`' PREFETCH)."""

    bn: int = 64
    gb: int = 8
    warps: int = 4
    stages: int = 3
    waves: int = 8
    prefetch: bool = False


LARGE_GEMV_ELEMENTS = 16 * 2 ** 20


def gemv_launch_for(n: int, k: int) -> GemvLaunch:
    """The one-row launch measured fastest on an H100 for this kind of matrix (random int4
    matrices of the SmolLM2-135M and Llama-3.2-1B shapes, docs/measurements.md round 13): for
    the two largest (gate/up and down of the 1B shape) two warps per program and the long
    matrix split; else 32 groups per step of four warps, narrow tiles (8 columns below
    GEMM_MIN_ELEMENTS, 16 from there), unsplit: a split's second kernel cost whole steps more
    than it saved on the products."""
    if n * k >= LARGE_GEMV_ELEMENTS:
        if k >= 4 * n:  # long (down)
            return GemvLaunch(bn=16, gb=32, warps=2, waves=4)
        return GemvLaunch(bn=32, gb=16, warps=2, waves=1)
    return GemvLaunch(bn=8 if n * k < GEMM_MIN_ELEMENTS else 16, gb=32, warps=4, waves=1)


def launch_for(rows: int, n: int, k: int) -> Launch:
    """The launch measured fastest for this kind of product (random int4 matrices of the
    SmolLM2-135M and Llama-3.2-1B shapes): prefill chunks (more than MAX_BLOCK_M rows) on an
    H200, wide tiles of `_int4_gemm` that re-read the weights per 64 rows; decoding steps of 2
    to 64 rows on an H100 (docs/measurements.md round 14), transposed tiles of 64 columns with
    the input axis split 8 ways (2 over fewer than 1,024 inputs: of the 1 and 2 ways tried there
    for 576 inputs), except that the wide gate/up matrices split fewer ways as the rows grow
    (their float32 partial sums grow with the rows: at 64 rows the 16384 x 2048 matrix ran
    fastest unsplit)."""
    if rows > MAX_BLOCK_M:
        return Launch(bn=128, unroll=4, waves=4)
    waves = (2 if rows > 32 else 4 if rows > 16 else 8) if n >= 4 * k else 8
    return Launch(bn=64, unroll=2, waves=waves, split_cap=False, max_split=8 if k >= 1024 else 2, transposed=True)


def scale_pairs(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """Float32 scales and minimums [..., N, K/32] -> [..., K/32, N, 2] (scale, minimum) pairs on
    their device: float16 where every pair is finite in it (exact for Q4_0 and Q4_1, whose
    fields are float16), else float32."""
    pairs = torch.stack([scale, minimum], dim=-1).transpose(-3, -2).contiguous()
    half = pairs.half()
    return half if bool(torch.isfinite(half).all()) else pairs


# The tensor cores' operand type: activations are rounded to it (the nibbles are exact in it).
OPERAND = tl.bfloat16 if AVAILABLE else None

_SCRATCH: dict[str, list[torch.Tensor]] = {}


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    held = _SCRATCH.setdefault(str(device), [])
    if not held or held[-1].numel() < numel:
        held.append(torch.empty(numel, dtype=torch.bfloat16, device=device))
    return held[-1]


if AVAILABLE:
    from engine.cuda_attention import dependent_start
    from engine.cuda_elementwise import silu_times

    _SHIFT = tl.constexpr(SUBNORMAL_SHIFT)

    @triton.jit
    def add_group(acc, dot, scale, xsum, minimum):
        """acc + scale * dot, then + minimum * xsum: a group's scaled sums added to the output as
        two float32 fused multiply-adds, the CPU kernels' order (operands broadcast by the caller)."""
        return tl.fma(xsum, minimum, tl.fma(dot, scale, acc))

    @triton.jit
    def _unbiased(bits):
        """v as float32 from the int32 bits of 2**23 + v (0 <= v < 2**23): the bits read as a
        float and 2**23 taken off, both exact, with no integer conversion (a quarter to an
        eighth of the arithmetic rate on sm_90)."""
        return bits.to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def group_weights(q_ptr, sm_ptr, n, nm, g, N, K, OPERAND: tl.constexpr):
        """Group g of columns n: the nibbles as OPERAND values [BN, 32] in input order, and each
        column's scale and minimum [BN] as float32."""
        qb = tl.load(q_ptr + n[:, None] * (K // 2) + (g * 16 + tl.arange(0, 16))[None, :], mask=nm[:, None], other=0)
        pair = sm_ptr + (g * N + n) * 2
        scale = tl.load(pair, mask=nm, other=0.0).to(tl.float32)
        minimum = tl.load(pair + 1, mask=nm, other=0.0).to(tl.float32)
        # Byte j holds inputs 2j (high nibble) and 2j + 1 (low): joined, they are the group in order,
        # each OR-ed into the bits of 2**23 to be made a float.
        q32 = qb.to(tl.int32)
        q = _unbiased(tl.reshape(tl.join(q32 >> 4, q32 & 15), (qb.shape[0], 32)) | 0x4B000000).to(OPERAND)
        return q, scale, minimum

    @triton.jit
    def group_product(x_ptr, q_ptr, sm_ptr, m, n, mm, nm, g, N, K, stride_x, acc, OPERAND: tl.constexpr):
        """acc [BM, BN] with group g's contribution added: acc + scale * (x . q), then
        + minimum * sum(x), each one float32 fused multiply-add (the CPU kernels' order)."""
        row = x_ptr + m[:, None] * stride_x + g * 32
        x = tl.load(row + tl.arange(0, 32)[None, :], mask=mm[:, None], other=0.0).to(OPERAND)
        q, scale, minimum = group_weights(q_ptr, sm_ptr, n, nm, g, N, K, OPERAND)
        dot = tl.dot(x, tl.trans(q))  # exact products, float32 sums
        return add_group(acc, dot, scale[None, :], tl.sum(x.to(tl.float32), axis=1)[:, None], minimum[None, :])

    @triton.jit
    def group_product_t(x_ptr, q_ptr, sm_ptr, m, n, mm, nm, g, N, K, stride_x, acc, OPERAND: tl.constexpr):
        """group_product transposed: acc [BN, BM] (columns n by rows m), the same sums.  The
        nibbles are the tensor cores' first operand, which they read from registers, so the
        nibbles made numbers go straight in; the activations, the second, go through shared
        memory as the loads' pipeline brings them.  The group's sums of the activations come
        from the tensor cores too (ones times x, exact products, float32 sums), laid out as acc
        already, where a sum across threads and a change of layout cost several barriers."""
        q, scale, minimum = group_weights(q_ptr, sm_ptr, n, nm, g, N, K, OPERAND)
        x = tl.load(x_ptr + m[None, :] * stride_x + (g * 32 + tl.arange(0, 32))[:, None], mask=mm[None, :],
                    other=0.0).to(OPERAND)  # [32, BM]
        dot = tl.dot(q, x)
        xsum = tl.dot(tl.full(q.shape, 1.0, OPERAND), x)
        return add_group(acc, dot, scale[:, None], xsum, minimum[:, None])

    @triton.jit
    def store_gated(acc, row_ptr, j0, n_out, row_mask):
        """SwiGLU of a tile of sums [R, 2 * C] whose columns are gate/up pairs (gate j, then up j),
        stored as [R, C] at row_ptr (a pointer per row) from output column j0, n_out columns in
        all: the float32 formula of engine.cuda_elementwise's kernel, so the same bits."""
        gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
        j = j0 + tl.arange(0, acc.shape[1] // 2)
        tl.store(row_ptr + j[None, :], silu_times(gate, up, tl.float32).to(row_ptr.dtype.element_ty),
                 mask=row_mask & (j < n_out)[None, :])

    # Row counts and split lengths are not specialized on (Triton compiles a variant for
    # values of 1 and multiples of 16 otherwise): prompts of every length reach these kernels,
    # and each new variant cost a compile of up to a second in the middle of a case.
    @triton.jit(do_not_specialize=["M", "groups_per_split"])
    def _int4_gemm(x_ptr, q_ptr, sm_ptr, out_ptr, M, N, K, stride_x, groups_per_split,
                   BM: tl.constexpr, BN: tl.constexpr, UNROLL: tl.constexpr, ADD: tl.constexpr,
                   OPERAND: tl.constexpr, TRANSPOSED: tl.constexpr, GATED: tl.constexpr = False,
                   DEPENDENT: tl.constexpr = False):
        """A [BM, BN] tile of x @ W^T per program, over its split's groups; TRANSPOSED: the tile
        computed columns by rows (`group_product_t`, decoding steps) and written back as
        [rows, columns], the same sums.  GATED (one split, columns in gate/up pairs): the tile's
        SwiGLU written instead, [BM, BN / 2] of a [M, N / 2] output (`store_gated`).  DEPENDENT:
        launched as a programmatic dependent (`dependent_start`: it waits before it reads)."""
        dependent_start(DEPENDENT)
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        split = tl.program_id(2)
        mm = m < M
        nm = n < N
        g0 = split * groups_per_split
        if TRANSPOSED:
            acc = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
        for c in range(0, groups_per_split // UNROLL):
            for u in tl.static_range(UNROLL):  # independent groups: their loads are in flight together
                g = g0 + c * UNROLL + u
                if TRANSPOSED:
                    acc = group_product_t(x_ptr, q_ptr, sm_ptr, m, n, mm, nm, g, N, K, stride_x, acc, OPERAND)
                else:
                    acc = group_product(x_ptr, q_ptr, sm_ptr, m, n, mm, nm, g, N, K, stride_x, acc, OPERAND)
        if GATED:
            gated_rows = out_ptr + m[:, None] * (N // 2)
            if TRANSPOSED:
                store_gated(tl.trans(acc), gated_rows, tl.program_id(1) * (BN // 2), N // 2, mm[:, None])
            else:
                store_gated(acc, gated_rows, tl.program_id(1) * (BN // 2), N // 2, mm[:, None])
        else:
            if TRANSPOSED:
                out = out_ptr + split * M * N + m[None, :] * N + n[:, None]
                mask = mm[None, :] & nm[:, None]
            else:
                out = out_ptr + split * M * N + m[:, None] * N + n[None, :]
                mask = mm[:, None] & nm[None, :]
            if ADD:  # out += x @ W^T (one split)
                acc += tl.load(out, mask=mask, other=0.0)
            tl.store(out, acc, mask=mask)

    @triton.jit
    def _step_words(w_ptr, n, nm, word, wm, words_per_row):
        """[BN, GB * 4] int32: the nibble words `word` (masked by wm) of columns n (by nm)."""
        return tl.load(w_ptr + n[:, None] * words_per_row + word[None, :], mask=nm[:, None] & wm[None, :], other=0)

    @triton.jit
    def gemv_columns(x_ptr, w_ptr, sm_ptr, n, nm, N, K, g0, n_groups, BN: tl.constexpr, GB: tl.constexpr,
                     OPERAND: tl.constexpr, PREFETCH: tl.constexpr, WAIT: tl.constexpr = False):
        """[BN] float32: one row x (K values) times columns `n` (masked by `nm`) of the int4
        matrix whose nibbles are the int32 words at w_ptr, over groups g0 .. g0 + n_groups, on
        the CUDA cores, GB groups per loop step (the last step masked).

        A step is one [BN, 4 * GB] tile of words, a group's four words side by side, so a
        thread loads a whole group (16 bytes) of each of its columns and the activations it
        needs (that group's 32) serve all of them: each activation is rounded, scaled and
        summed once per thread, not once per column.  Each nibble is the float32 subnormal its
        bits make, the activations scaled to match and each group's sum scaled back
        (SUBNORMAL_SHIFT).
        PREFETCH: each step loads the next step's words before it computes, so their reads
        are in flight during the arithmetic (the same sums).  WAIT (a kernel launched as a
        dependent): before it reads x it waits for the kernel before it, which writes x; with
        PREFETCH, after it has asked for the first step's words."""
        WB: tl.constexpr = 4 * GB
        wi = tl.arange(0, WB)  # word i of a step: group i // 4, its inputs 8 * (i % 4) ..
        gi = tl.arange(0, GB)
        words_per_row = tl.multiple_of(K // 8, 4)  # K is whole groups: a group's 4 words load as one
        acc = tl.zeros([BN, GB], tl.float32)
        if PREFETCH:
            w_next = _step_words(w_ptr, n, nm, g0 * 4 + wi, wi < 4 * n_groups, words_per_row)
        if WAIT:  # launched as a dependent: the kernel before writes x
            gdc_wait()
        for c in range(0, n_groups, GB):
            wm = c * 4 + wi < 4 * n_groups
            gm = c + gi < n_groups
            word = (g0 + c) * 4 + wi  # [WB]
            if PREFETCH:
                w = w_next
                w_next = _step_words(w_ptr, n, nm, word + WB, (c + GB) * 4 + wi < 4 * n_groups, words_per_row)
            else:
                w = _step_words(w_ptr, n, nm, word, wm, words_per_row)
            dot = tl.zeros([BN, WB], tl.float32)
            xsum = tl.zeros([WB], tl.float32)
            # Byte b of a word holds inputs 8i+2b (high nibble) and 8i+2b+1 (low).
            shifted = w >> 12  # its nibbles at bits 20 and up moved into the mantissa
            for b in tl.static_range(4):
                xh = tl.load(x_ptr + word * 8 + 2 * b, mask=wm, other=0.0)
                xl = tl.load(x_ptr + word * 8 + 2 * b + 1, mask=wm, other=0.0)
                xh = xh.to(OPERAND).to(tl.float32)
                xl = xl.to(OPERAND).to(tl.float32)
                # The nibble at bit s (of w, or of w >> 12 from bit 20 on) read as a float is
                # q * 2**(s - 149) and meets x * 2**(149 - s - E): the exact product q * x, times 2**-E.
                source = w if b < 2 else shifted  # its low nibble at bit 8b - 12(b // 2)
                qh = (source & (15 << (8 * b - 12 * (b // 2) + 4))).to(tl.float32, bitcast=True)
                ql = (source & (15 << (8 * b - 12 * (b // 2)))).to(tl.float32, bitcast=True)
                xh_scaled = xh * (2.0 ** (145 - _SHIFT - 8 * b + 12 * (b // 2)))
                xl_scaled = xl * (2.0 ** (149 - _SHIFT - 8 * b + 12 * (b // 2)))
                dot = tl.fma(qh, xh_scaled[None, :], dot)
                dot = tl.fma(ql, xl_scaled[None, :], dot)
                xsum += xh + xl
            pair = sm_ptr + ((g0 + c + gi)[None, :] * N + n[:, None]) * 2  # [BN, GB]
            pm = nm[:, None] & gm[None, :]
            scale = tl.load(pair, mask=pm, other=0.0).to(tl.float32)
            minimum = tl.load(pair + 1, mask=pm, other=0.0).to(tl.float32)
            group_dot = tl.sum(tl.reshape(dot, (BN, GB, 4)), axis=2)  # a group's four words together
            group_dot = group_dot * (2.0 ** _SHIFT)  # back to the sums themselves, exactly
            group_x = tl.sum(tl.reshape(xsum, (GB, 4)), axis=1)
            acc = add_group(acc, group_dot, scale, group_x[None, :], minimum)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _int4_gemv(x_ptr, w_ptr, sm_ptr, out_ptr, N, K, stride_x, groups_per_split,
                   BN: tl.constexpr, GB: tl.constexpr, ADD: tl.constexpr, PREFETCH: tl.constexpr,
                   OPERAND: tl.constexpr, DEPENDENT: tl.constexpr, GATED: tl.constexpr = False):
        """Rows one by one, a row per program along axis 2: the same sums as _int4_gemm on the
        CUDA cores (`gemv_columns`), each row's in the order it has alone; GATED as _int4_gemm's."""
        if DEPENDENT:  # the next kernel may launch; gemv_columns waits for the one before
            gdc_launch_dependents()
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        split = tl.program_id(1)
        row = tl.program_id(2)
        nm = n < N
        y = gemv_columns(x_ptr + row * stride_x, w_ptr, sm_ptr, n, nm, N, K, split * groups_per_split,
                         groups_per_split, BN, GB, OPERAND, PREFETCH or DEPENDENT, DEPENDENT)
        if GATED:
            store_gated(y[None, :], out_ptr + row * (N // 2), tl.program_id(0) * (BN // 2), N // 2,
                        tl.full((1, 1), 1, tl.int1))
        else:
            out = out_ptr + (split * tl.num_programs(2) + row) * N + n
            if ADD:  # out += x @ W^T (one split: the residual stream, updated in place)
                y += tl.load(out, mask=nm, other=0.0)
            tl.store(out, y, mask=nm)

    @triton.jit
    def split_sum(part_ptr, i, mask, stride, SPLITS: tl.constexpr):
        acc = tl.load(part_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):  # a fixed order: the same sums every time
            acc += tl.load(part_ptr + s * stride + i, mask=mask, other=0.0)
        return acc

    @triton.jit(do_not_specialize=["total"])
    def _add_splits(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                    DEPENDENT: tl.constexpr, GATED: tl.constexpr = False):
        """out (`total` elements) = the SPLITS partial sums added in split order (+ out's own
        values with ADD); GATED: out holds `total` SwiGLU values, of the sums' gate/up pairs."""
        dependent_start(DEPENDENT)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        if GATED:  # output i is the pair (2i, 2i + 1) of the [splits, rows, N = 2 * N / 2] sums
            gate = split_sum(part_ptr, 2 * i, mask, 2 * total, SPLITS)
            up = split_sum(part_ptr, 2 * i + 1, mask, 2 * total, SPLITS)
            tl.store(out_ptr + i, silu_times(gate, up, tl.float32).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            acc = split_sum(part_ptr, i, mask, total, SPLITS)
            if ADD:  # added to what the output held, after the product's own sum
                acc += tl.load(out_ptr + i, mask=mask, other=0.0)
            tl.store(out_ptr + i, acc, mask=mask)

    @triton.jit
    def _dequantize(q_ptr, sm_ptr, out_ptr, N, K, BN: tl.constexpr, BB: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        byte = tl.program_id(1) * BB + tl.arange(0, BB)  # byte j holds inputs 2j (high) and 2j+1 (low)
        nm = n < N
        mask = nm[:, None] & (byte < K // 2)[None, :]
        q = tl.load(q_ptr + n[:, None] * (K // 2) + byte[None, :], mask=mask, other=0).to(tl.int32)
        pair = sm_ptr + (((2 * byte) // 32)[None, :] * N + n[:, None]) * 2
        scale = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
        minimum = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
        high = ((q >> 4).to(tl.float32) * scale + minimum).to(tl.bfloat16)
        low = ((q & 15).to(tl.float32) * scale + minimum).to(tl.bfloat16)
        # Joined, the two nibbles of each byte are a row's inputs in order: one contiguous store
        # per row (two interleaved stores of every other value ran 4-13x slower on an H100).
        col = tl.program_id(1) * 2 * BB + tl.arange(0, 2 * BB)
        tl.store(out_ptr + n[:, None] * K + col[None, :], tl.reshape(tl.join(high, low), (BN, 2 * BB)),
                 mask=nm[:, None] & (col < K)[None, :])


def _outputs(rows: int, n: int, splits: int, device: torch.device, into: torch.Tensor | None,
             gated: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The product's float32 [rows, n] output (`into`, where the product is added to it; with
    `gated`, its SwiGLU [rows, n / 2] of that dtype) and where the kernel writes: the output
    itself, or [splits, rows, n] float32 partial sums."""
    if gated is not None:
        out = torch.empty((rows, n // 2), dtype=gated, device=device)
    else:
        out = torch.empty((rows, n), dtype=torch.float32, device=device) if into is None else into
    return out, (out if splits == 1 else torch.empty((splits, rows, n), dtype=torch.float32, device=device))


def _add_up(part: torch.Tensor, out: torch.Tensor, splits: int, add: bool, gated: bool = False) -> torch.Tensor:
    if splits > 1:
        total, block = out.numel(), 1024
        dependent = dependent_launch(out.device)
        _add_splits[(triton.cdiv(total, block),)](part, out, total, SPLITS=splits, BLOCK=block, ADD=add,
                                                  DEPENDENT=dependent, GATED=gated, launch_pdl=dependent,
                                                  num_warps=4)
    return out


def _accepts(into: torch.Tensor, rows: int, n: int) -> bool:
    return into.dtype == torch.float32 and into.shape == (rows, n) and into.is_contiguous()


class Int4Weight:
    """An int4 matrix on a CUDA device; `w(x)` is x @ W^T in float32 (see the module docstring)."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, device: torch.device):
        """From host arrays: q [N, K] 4-bit values, scale and minimum [N, K/32]."""
        nibbles = torch.from_numpy(np.ascontiguousarray((q[:, ::2] << 4) | q[:, 1::2])).to(device)

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device)

        self._hold(nibbles, scale_pairs(tensor(scale), tensor(minimum)))

    @classmethod
    def from_nibbles(cls, nibbles: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> "Int4Weight":
        """The matrix from tensors already on its device (engine.device_blocks.int4_groups):
        nibbles uint8 [N, K/2] in this module's layout, scale and minimum float32 [N, K/32]."""
        self = cls.__new__(cls)
        self._hold(nibbles, scale_pairs(scale, minimum))
        return self

    def _hold(self, nibbles: torch.Tensor, pairs: torch.Tensor, paired: bool = False) -> None:
        self.n, self.k = nibbles.shape[0], nibbles.shape[1] * 2
        if self.k % GROUP:
            raise ValueError(f"int4 weights need in_features divisible by {GROUP}, got {self.k}")
        self.nibbles = nibbles.contiguous()
        self.words = self.nibbles.view(torch.int32)  # the same bytes, four to a word (one-row products)
        self.pairs = pairs
        self.gemm_rows = gemm_rows_for(self.n, self.k)
        self.gemv_rows = gemv_rows_for(self.n, self.k)
        self.paired = paired  # rows in gate/up pairs (`paired_halves`)

    def paired_halves(self) -> "Int4Weight":
        """This [gate; up] matrix (gate's n/2 rows, then up's) with its rows reordered gate 0,
        up 0, gate 1, up 1, ..., for `swiglu`: every output tile of the products then holds
        whole pairs, and ends in their SwiGLU.  Its plain products (`w(x)`) give the columns in
        that order."""
        if self.n % 2:
            raise ValueError(f"a gate/up matrix has an even number of rows, not {self.n}")
        order = torch.arange(self.n, device=self.nibbles.device).view(2, self.n // 2).t().reshape(-1)
        paired = Int4Weight.__new__(Int4Weight)
        paired._hold(self.nibbles[order], self.pairs[:, order].contiguous(), paired=True)
        return paired

    def swiglu(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] -> silu(x @ G^T) * (x @ U^T) [M, N / 2] in `out_dtype`, for a matrix made by
        `paired_halves`: the product's last kernel computes it from the float32 sums (the
        cuBLAS path's bfloat16 products through engine.cuda_elementwise's kernel), by the
        formula of that kernel, so the same bits as the product and then that kernel, one
        kernel and one [M, N] tensor fewer."""
        if not self.paired:
            raise ValueError("swiglu needs a matrix made by paired_halves")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        if rows >= self.gemm_rows:
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight())
            return cuda_elementwise.swiglu(y, out_dtype, torch.float32, paired=True)
        return self.gemv(x, gated=out_dtype) if rows <= self.gemv_rows else self.fused(x, gated=out_dtype)

    @property
    def nbytes(self) -> int:
        return self.nibbles.nbytes + self.pairs.nbytes

    def __call__(self, x: torch.Tensor, into: torch.Tensor | None = None, narrow: bool = False) -> torch.Tensor:
        """x [M, K] -> x @ W^T [M, N] float32; with `into` ([M, N] float32), into += x @ W^T
        (in the product's last kernel where `into` is contiguous) and `into` is returned.  With
        `narrow`, a product that cuBLAS rounded to bfloat16 comes back as it is: the same values
        as float32 in half the bytes."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        if rows >= self.gemm_rows:
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight())
            # into += y reads the bfloat16 product as it is: the same float32 sums as adding
            # y.float(), without writing that copy out and reading it back
            return (y if narrow else y.float()) if into is None else into.add_(y)
        # Prefill-sized products add afterwards: with the output tile loaded too, the wide
        # tiles of many rows ran slower than the separate addition costs.
        if into is not None and (rows > ADD_IN_KERNEL_ROWS or not _accepts(into, rows, self.n)):
            into += self(x)
            return into
        return self.gemv(x, into=into) if rows <= self.gemv_rows else self.fused(x, into=into)

    def gemv(self, x: torch.Tensor, launch: "GemvLaunch | None" = None,
             into: torch.Tensor | None = None, gated: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] float32 (each row of x contiguous), or added to `into`, or with
        `gated` its SwiGLU (`swiglu`): each row as the one-row kernel computes it alone, one
        launch for all."""
        rows = x.shape[0]
        cfg = launch or gemv_launch_for(self.n, self.k)
        n_groups = self.k // GROUP
        tiles = triton.cdiv(self.n, cfg.bn)
        # Split as for one row, whatever the rows: each row's sums then run in its one-row order.
        splits = split_k(n_groups, tiles, cfg.waves * multiprocessors(x.device))
        out, part = _outputs(rows, self.n, splits, x.device, into, gated)
        add = into is not None
        dependent = dependent_launch(x.device)
        _int4_gemv[(tiles, splits, rows)](x, self.words, self.pairs, part, self.n, self.k, x.stride(0),
                                          n_groups // splits, BN=cfg.bn, GB=cfg.gb, ADD=add and splits == 1,
                                          PREFETCH=cfg.prefetch, OPERAND=OPERAND, DEPENDENT=dependent,
                                          GATED=gated is not None and splits == 1, launch_pdl=dependent,
                                          num_warps=cfg.warps, num_stages=cfg.stages)
        return _add_up(part, out, splits, add, gated is not None)

    def fused(self, x: torch.Tensor, launch: "Launch | None" = None,
              into: torch.Tensor | None = None, gated: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] float32 by the tensor-core kernel, or added to `into`, or with
        `gated` its SwiGLU (`swiglu`)."""
        rows = x.shape[0]
        cfg = launch or launch_for(rows, self.n, self.k)
        bm = block_m(rows)
        tiles_m, tiles_n = triton.cdiv(rows, bm), triton.cdiv(self.n, cfg.bn)
        n_groups = self.k // GROUP
        cap = min(cfg.max_split, max(1, self.k // (16 * rows))) if cfg.split_cap else cfg.max_split
        splits = split_k(n_groups, tiles_m * tiles_n, cfg.waves * multiprocessors(x.device), max_split=cap)
        per = n_groups // splits
        unroll = next(u for u in (cfg.unroll, 2, 1) if per % u == 0)
        out, part = _outputs(rows, self.n, splits, x.device, into, gated)
        add = into is not None
        dependent = dependent_launch(x.device) and self.n * self.k <= DEPENDENT_GEMM_ELEMENTS
        _int4_gemm[(tiles_m, tiles_n, splits)](x, self.nibbles, self.pairs, part, rows, self.n, self.k,
                                               x.stride(0), per, BM=bm, BN=cfg.bn, UNROLL=unroll,
                                               ADD=add and splits == 1, OPERAND=OPERAND, TRANSPOSED=cfg.transposed,
                                               GATED=gated is not None and splits == 1, DEPENDENT=dependent,
                                               launch_pdl=dependent, num_warps=cfg.warps, num_stages=cfg.stages)
        return _add_up(part, out, splits, add, gated is not None)

    def weight(self) -> torch.Tensor:
        """W as bfloat16 [N, K] in the shared scratch (valid until the next call on this device)."""
        out = _scratch(self.n * self.k, self.nibbles.device)[: self.n * self.k].view(self.n, self.k)
        bn, bb = 16, 128
        grid = (triton.cdiv(self.n, bn), triton.cdiv(self.k // 2, bb))
        _dequantize[grid](self.nibbles, self.pairs, out, self.n, self.k, BN=bn, BB=bb)
        return out
