"""Mixture-of-experts FFNs on CUDA with no host synchronisation: Triton kernels over a layer's
routed experts held stacked.

`StackedExperts.build(gate, up, down, device)` takes the 3-D expert tensors of one layer
(`ffn_{gate,up,down}_exps`, torch order [n_expert, rows, cols]) and holds them as two stacked
matrices, gate/up [n_expert, 2 * n_ff, n_embd] (each expert's gate rows, then its up rows) and
down [n_expert, n_embd, n_ff] (`StackedWeight`).  Q4_0, Q4_1 and Q4_K stay 4-bit in
engine.cuda_int4's layout (nibbles two per byte, even input high; per group of 32 inputs and
output column the pair (scale, minimum), float16 where every pair of the stack is finite in
it, else float32).  The 5-, 6- and 8-bit grouped types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, Q3_K,
Q2_K, IQ4_NL, IQ4_XS) are held as int8 values with the same pairs per group of 32 or 16, 1.125
or 1.25 bytes a weight (a Q4_K_M file's Q6_K down projections, and the Q5_0 that llama.cpp
writes for rows that are not whole Q4_K blocks, such as DeepSeek-V2-Lite's 1408-wide experts).
Both are unpacked on the device from the file's blocks as stored, a few experts at a time
(engine.device_blocks, the host's numbers bit for bit).  Every other type (F16, BF16, F32) is
dequantized once to bfloat16.

`experts(h, ids, weights, into=x)`: h [T, n_embd] (float32 or bfloat16), ids [T, k] (each row's
experts, on the device), weights [T, k] float32 -> float32 [T, n_embd], each row's
sum over its k slots, in slot order, of weight * down(silu(gate(h)) * up(h)) of that slot's
expert; with `into` ([T, n_embd] float32, the residual stream) the sum is added to it in the last
kernel.  Nothing is read back to the host and every launch shape depends only on T, k and the
weights' shapes, so the call can be captured in a CUDA graph (engine.cuda_graphs).  The
arithmetic is engine.cuda_int4's: activations rounded to bfloat16, the products with the
nibbles or int8 values (or bfloat16 weights) exact, summed in float32 per group, then scale
and minimum * (sum of the group's activations) in float32.  The gate/up outputs stay float32
for the SwiGLU.

Two shapes of work, by rows:

- up to `GEMV_MAX_ROWS` rows (decoding one or a few sequences): an indexed product on the CUDA
  cores, engine.cuda_int4's one-row loop.  Gate/up runs one program per (row, slot, column
  tile), reading its expert's id from the device, and writes silu(gate) * up; down runs one
  program per (row, column tile), looping over the row's k slots in order, so a row's sum is
  formed in one place without atomics and added to the residual there.  `MoeLaunch` can
  instead read a tile's gate and up columns in one pass, and run down as a program per
  (row, slot, column tile) whose products one more kernel adds in slot order: k times the
  programs, for GPUs that one program per row leaves mostly idle.
- more rows (prefill chunks, wide decoding batches): the (row, slot) pairs are grouped by
  expert on the device (`group_by_expert`, one kernel: counts per expert, each expert's pairs
  padded to a whole number of `block_m` blocks, in pair order within an expert, and the owner
  expert of every block; the grid covers the most blocks T * k pairs can need, and blocks past
  the last do nothing), then a grouped tensor-core product runs each block against its
  expert's weights once, gate/up fused with the SwiGLU, and down scaled by each pair's weight;
  one more kernel sums a row's k slots in order and adds them to the residual.  Its tiles are
  computed transposed, columns by pairs (engine.cuda_int4.group_product_t's order: the weights
  the operand the tensor cores read from registers, the group sums of the activations from
  ones times them, one load of a block's activations for its gate and up tiles); rows by
  columns remains a launch choice (`MoeLaunch.gemm_transposed_bm`).

Within each shape a row's result depends on its own routing and activations only, not on the
other rows; the two shapes sum a group's products in different orders, so a row decoded alone
and in a wide batch differ in the last bits of float32 sums (tests bound it).  Padding rows of
a captured graph's bucket are routed and computed like any other.

`route_softmax(scores, k, renormalise)` is engine.models.qwen_moe's routing rule (softmax, the
k most probable, ties to the lower index, optionally renormalised) in one kernel per step and
layer instead of torch's six, and `route_grouped(...)` is engine.models.deepseek2's (softmax or
sigmoid, an expert bias for the choice, group-limited top-k, renormalisation and scale).

`matrix_products(x, stack)` runs the indexed one-row product over any stack of matrices, row t's
input e through matrix e: deepseek2 holds its per-head absorbed projections W_k and W_v so.

Without Triton (`AVAILABLE` False) nothing here runs; engine.models keeps the per-expert path.
It knows nothing of shared experts or of the models' tensors' names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from gguf import GGMLQuantizationType as QT

from engine import device_blocks
from engine.cuda_attention import AVAILABLE, dependent_launch, tl, triton
from engine.cuda_int4 import GROUP, OPERAND, scale_pairs
from engine.gguf_file import TensorRecord
from engine.quants import INT4_GROUPED, INT8_GROUPED, INT8_GROUPS
from engine.weights import to_float

if AVAILABLE:
    from engine.cuda_attention import dependent_start
    from engine.cuda_int4 import add_group, gemv_columns, group_product, group_weights

# The few-row down product's shapes of work (MoeLaunch.gemv_down).
DOWN_SHAPES = ("rows", "pairs")
GEMV_MAX_ROWS = 8  # rows up to which the indexed one-row products run; more take the grouped GEMM
ALIGN_ELEMENTS = 16384  # (pair, expert) comparisons `_align` makes at once: pairs per chunk x experts
CHUNK_WEIGHTS = 1 << 26  # weights of a part unpacked at once while a stack is built
# The most rows whose routing and expert kernels are launched as programmatic dependents where
# the dense ones are (`cuda_attention.dependent_launch`; 0: none): each lets the next kernel launch
# as it starts, then waits for the one before it before reading anything, so a launch overlaps
# the end of the kernel before it.  The same bits.  On an H100 one row's steps ran 1.04x
# (Qwen3-30B-A3B's shape) and 1.07x (DeepSeek-V2-Lite's) faster so, and 32 rows' 0.975x and
# 0.99x (tests/engine/moe_timing.py --dependent; docs/measurements.md, round 26): the grouped
# GEMM is left to launch after the kernel before it.
DEPENDENT_EXPERT_ROWS = GEMV_MAX_ROWS


@dataclass(frozen=True)
class MoeLaunch:
    """Launch shapes.  The indexed products: columns per program, groups per loop step and
    warps, whether a loop step loads the next one's weights first (`gemv_prefetch`, as
    engine.cuda_int4.GemvLaunch.prefetch) and how the down product spreads over programs
    (`gemv_down`, one of DOWN_SHAPES: a program per row and column tile looping over the row's
    slots, or a program per (row, slot) pair and one more kernel adding a row's slots in
    order).  The grouped GEMM: columns per program, warps, pipeline stages, groups per loop
    step (at most), and the largest block (`block_m`) whose tiles are computed transposed,
    columns by pairs (`gemm_transposed_bm`; 0: every block rows by columns).  The defaults are
    the fastest of sweeps on an H100 (tests/engine/moe_timing.py --sweep, 26 and 48 layers'
    routed experts replayed from a graph, random files of DeepSeek-V2-Lite's and
    Qwen3-30B-A3B's shapes): at 1 row 0.98 ms against 1.29 ms with the down product a program
    per row and 8 warps, and 1.51 against 1.78 ms; at 32 rows, transposed 64-column tiles with
    3 stages 9.05 ms against 10.48 ms rows by columns with 128 columns and 4 stages, and 16.33
    against 19.44 ms (docs/measurements.md, round 15).  Loading ahead measured no faster there
    (off).  The grouped GEMM reads its inputs as the operand type it rounds them to, the same
    bits (`gemm_narrow_act`: the SwiGLU's activations stored so; `gemm_narrow_input`: the
    gate/up product's input rounded before the product): on an H100 both together made every
    layer's routed experts 1.14-1.21x faster at 32 and 64 rows and whole steps 1.10-1.18x
    (round 28)."""

    gemv_bn: int = 16
    gemv_gb: int = 32
    gemv_warps: int = 4
    gemv_down: str = "pairs"
    gemv_prefetch: bool = False
    gemm_bn: int = 64
    gemm_warps: int = 4
    gemm_stages: int = 3
    gemm_unroll: int = 2
    gemm_transposed_bm: int = 64
    gemm_narrow_act: bool = True
    gemm_narrow_input: bool = True

    def __post_init__(self):
        if self.gemv_down not in DOWN_SHAPES:
            raise ValueError(f"gemv_down must be one of {DOWN_SHAPES}, got {self.gemv_down!r}")


LAUNCH = MoeLaunch()


def block_m(pairs: int, n_expert: int) -> int:
    """Pairs per grouped-GEMM block: 16 (the tensor cores' least) while an expert gets few
    pairs on average (decoding batches), more for prefill chunks."""
    mean = pairs / n_expert
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def max_blocks(pairs: int, n_expert: int, bm: int) -> int:
    """Blocks that `pairs` pairs grouped by expert can fill at most: sum over experts of
    ceil(count / bm) <= pairs / bm + the number of experts that have any."""
    return -(-pairs // bm) + min(n_expert, pairs)


# A stack's formats, by the index its kernels take (their FMT argument).
FORMATS = ("int4", "int8", "bf16")


def stack_format(qtypes: Sequence[QT]) -> str:
    """The format (of `FORMATS`) a stack of parts of these types is held in."""
    if all(t in INT4_GROUPED for t in qtypes):
        return "int4"
    return "int8" if all(t in INT4_GROUPED or t in INT8_GROUPED for t in qtypes) else "bf16"


class StackedWeight:
    """n_expert matrices of the same shape [n, k] held as one, in one of `FORMATS`:

    - int4 (Q4_0, Q4_1, Q4_K): `nibbles` [E, n, k/2] uint8 (`words`, the same bytes as int32),
      groups of 32;
    - int8 (the 5-, 6- and 8-bit grouped types, engine.quants.INT8_GROUPS, and mixtures with
      the 4-bit ones): `q` [E, n, k] int8, groups of `group` (16 or 32: the smallest of its
      parts');
    - bf16 (every other type): `dense` [E, n, k].

    The grouped formats hold `pairs` [E, k/group, n, 2], each group's (scale, minimum) per
    output column (a zero minimum for types without one), float16 where every pair of the
    stack is finite in it, else float32."""

    def __init__(self, parts: Sequence[TensorRecord], device: torch.device):
        """parts: 3-D expert tensors [n_expert, rows, k]; expert e's matrix is its rows of each
        part, one part after the other (gate's, then up's)."""
        shapes = {(r.shape[0], r.shape[2]) for r in parts}
        if len(shapes) != 1 or any(len(r.shape) != 3 for r in parts):
            raise ValueError(f"cannot stack {[(r.name, r.shape) for r in parts]} as one matrix per expert")
        (self.n_expert, self.k), = shapes
        self.n = sum(r.shape[1] for r in parts)
        if self.k % GROUP:
            raise ValueError(f"stacked experts need in_features divisible by {GROUP}, got {self.k}")
        self.nibbles = self.words = self.q = self.pairs = self.dense = None
        self.group = GROUP
        self.format = stack_format([r.qtype for r in parts])
        if self.format == "int4":
            self._pack_int4(parts, device)
        elif self.format == "int8":
            self._pack_int8(parts, device)
        else:
            dense = torch.cat([torch.from_numpy(to_float(r)).to(torch.bfloat16) for r in parts], dim=1)
            self.dense = dense.contiguous().to(device)

    def _expert_chunks(self, record: TensorRecord, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
        """A part's bytes on `device`, `CHUNK_WEIGHTS` weights' worth of experts at a time:
        (those experts, their rows uint8 [experts * rows, row_bytes])."""
        raw = device_blocks.raw_rows(record, device)  # [E, rows * row_bytes]
        step = max(1, CHUNK_WEIGHTS // (record.shape[1] * self.k))
        for first in range(0, self.n_expert, step):
            chunk = raw[first: first + step]
            yield slice(first, first + chunk.shape[0]), chunk.reshape(chunk.shape[0] * record.shape[1], -1)

    def _fill(self, parts: Sequence[TensorRecord], device: torch.device, held: Sequence[torch.Tensor],
              unpack: Callable[[QT, torch.Tensor], Sequence[torch.Tensor]]) -> None:
        """Writes each part's rows of every expert into `held` ([E, n, ...] tensors on `device`),
        `unpack(qtype, raw rows)` giving one [rows, ...] tensor for each of `held`.  The file's
        blocks cross to the device as stored and are unpacked there (engine.device_blocks: the
        host's numbers bit for bit) a chunk of experts at a time: the unpacking's intermediates,
        a few bytes a weight, then take device memory for at most `CHUNK_WEIGHTS` weights beside
        the stack and the part's bytes, however large the stack (a DeepSeek-V2-Lite down
        stack of 198 MiB: 564 MiB more at the peak on a CPU unpacked whole, 334 MiB in chunks)."""
        first = 0
        for r in parts:
            rows = slice(first, first + r.shape[1])
            for experts, raw in self._expert_chunks(r, device):
                for into, t in zip(held, unpack(r.qtype, raw), strict=True):
                    into[experts, rows] = t.reshape(experts.stop - experts.start, r.shape[1], -1)
            first = rows.stop

    def _pack_int4(self, parts: Sequence[TensorRecord], device: torch.device) -> None:
        self.nibbles = torch.empty((self.n_expert, self.n, self.k // 2), dtype=torch.uint8, device=device)
        scale, minimum = (torch.empty((self.n_expert, self.n, self.k // GROUP), dtype=torch.float32, device=device)
                          for _ in range(2))
        self._fill(parts, device, (self.nibbles, scale, minimum),
                   lambda qtype, raw: device_blocks.int4_groups(qtype, raw, self.k))
        self.words = self.nibbles.view(torch.int32)
        self.pairs = scale_pairs(scale, minimum)

    def _pack_int8(self, parts: Sequence[TensorRecord], device: torch.device) -> None:
        # Unpacked on the device as the int4 stacks are: numpy on the host took most of a
        # Q5_0-heavy load (DeepSeek-V2-Lite's 1408-wide down projections).
        self.group = min(INT8_GROUPS.get(r.qtype, GROUP) for r in parts)  # the 4-bit types: groups of 32
        self.q = torch.empty((self.n_expert, self.n, self.k), dtype=torch.int8, device=device)
        scale, minimum = (torch.empty((self.n_expert, self.n, self.n_groups), dtype=torch.float32, device=device)
                          for _ in range(2))

        def unpack(qtype: QT, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            g = device_blocks.int8_groups(qtype, raw, self.k)
            # a larger group's scale and minimum (zero for types without one) once per smaller group
            return g.q, *((torch.zeros_like(g.scale) if v is None else v).repeat_interleave(g.group // self.group, 1)
                          for v in (g.scale, g.minimum))

        self._fill(parts, device, (self.q, scale, minimum), unpack)
        self.pairs = scale_pairs(scale, minimum)

    @property
    def format_index(self) -> int:
        return FORMATS.index(self.format)

    @property
    def n_groups(self) -> int:
        return self.k // self.group

    def row_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(matrices, scales) as the indexed one-row products read them: the int32 words (int4)
        or the int8 values, and the pairs; the bfloat16 stack twice (no scales are read)."""
        held = {"int4": (self.words, self.pairs), "int8": (self.q, self.pairs), "bf16": (self.dense, self.dense)}
        return held[self.format]

    def block_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(matrices, scales) as the grouped tensor-core products read them: the nibbles as bytes
        (16 per group) for int4, else as `row_operands`."""
        return (self.nibbles, self.pairs) if self.format == "int4" else self.row_operands()

    def dequantized(self) -> torch.Tensor:
        """float32 [E, n, k]: the matrices as the kernels see them (for tests and checks)."""
        if self.format == "bf16":
            return self.dense.float()
        pairs = self.pairs.float()
        if self.format == "int4":
            b = self.nibbles.to(torch.int32)
            q = torch.stack([b >> 4, b & 15], dim=-1).reshape(self.n_expert, self.n, self.k)
        else:
            q = self.q
        q = q.float().view(self.n_expert, self.n, self.n_groups, self.group)
        scale, minimum = (pairs[..., i].transpose(1, 2)[..., None] for i in (0, 1))  # [E, n, groups, 1]
        return (q * scale + minimum).view(self.n_expert, self.n, self.k)

    @property
    def nbytes(self) -> int:
        held = [self.nibbles, self.q, self.pairs] if self.format != "bf16" else [self.dense]
        return sum(t.nbytes for t in held if t is not None)


if AVAILABLE:
    @triton.jit
    def _dense_columns(x_ptr, w_ptr, n, nm, K, BN: tl.constexpr, BK: tl.constexpr, OPERAND: tl.constexpr):
        """[BN] float32: one row x times columns `n` of a bfloat16 matrix [*, K] at w_ptr (exact
        products of bfloat16 values, float32 sums)."""
        kk = tl.arange(0, BK)
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            km = k0 + kk < K
            w = tl.load(w_ptr + n[:, None] * K + (k0 + kk)[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + kk, mask=km, other=0.0).to(OPERAND).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _int8_values(q_ptr, n, nm, K, g, gm, G: tl.constexpr):
        """[BN, GB, G] int8: the values of groups g (masked by gm) of columns n (by nm)."""
        col = g[:, None] * G + tl.arange(0, G)[None, :]
        return tl.load(q_ptr + n[:, None, None] * K + col[None, :, :], mask=nm[:, None, None] & gm[None, :, None],
                       other=0)

    @triton.jit
    def _int8_columns(x_ptr, q_ptr, sm_ptr, n, nm, N, K, n_groups, G: tl.constexpr, BN: tl.constexpr,
                      GB: tl.constexpr, OPERAND: tl.constexpr, PREFETCH: tl.constexpr):
        """[BN] float32: one row x times columns `n` of an int8 matrix [N, K] at q_ptr with groups
        of G and (scale, minimum) pairs [K/G, N, 2] at sm_ptr: per group the exact products
        summed in float32, then scale * sum + minimum * (sum of the group's activations).
        PREFETCH as engine.cuda_int4.gemv_columns'."""
        gi = tl.arange(0, GB)
        j = tl.arange(0, G)
        acc = tl.zeros([BN, GB], tl.float32)
        if PREFETCH:
            q_next = _int8_values(q_ptr, n, nm, K, gi, gi < n_groups, G)
        for c in range(0, n_groups, GB):
            gm = c + gi < n_groups
            g = c + gi
            col = g[:, None] * G + j[None, :]  # [GB, G]
            if PREFETCH:
                q = q_next.to(tl.float32)
                q_next = _int8_values(q_ptr, n, nm, K, g + GB, c + GB + gi < n_groups, G)
            else:
                q = _int8_values(q_ptr, n, nm, K, g, gm, G).to(tl.float32)
            x = tl.load(x_ptr + col, mask=gm[:, None], other=0.0).to(OPERAND).to(tl.float32)
            pair = sm_ptr + (g[None, :] * N + n[:, None]) * 2  # [BN, GB]
            pm = nm[:, None] & gm[None, :]
            scale = tl.load(pair, mask=pm, other=0.0).to(tl.float32)
            minimum = tl.load(pair + 1, mask=pm, other=0.0).to(tl.float32)
            acc += tl.sum(q * x[None, :, :], axis=2) * scale + tl.sum(x, axis=1)[None, :] * minimum
        return tl.sum(acc, axis=1)

    @triton.jit
    def _expert_columns(x_ptr, w_ptr, sm_ptr, e, n, nm, N, K, n_groups, FMT: tl.constexpr, G: tl.constexpr,
                        BN: tl.constexpr, GB: tl.constexpr, OPERAND: tl.constexpr, PREFETCH: tl.constexpr):
        """[BN] float32: one row x times columns `n` of expert e's [N, K] matrix in format FMT
        (an index into FORMATS: int4, int8, bf16), K = G * n_groups."""
        if FMT == 0:
            y = gemv_columns(x_ptr, w_ptr + e * N * (K // 8), sm_ptr + e * n_groups * N * 2, n, nm, N, K,
                             0, n_groups, BN, GB, OPERAND, PREFETCH)
        elif FMT == 1:
            y = _int8_columns(x_ptr, w_ptr + e * N * K, sm_ptr + e * n_groups * N * 2, n, nm, N, K, n_groups, G,
                              BN, GB, OPERAND, PREFETCH)
        else:
            y = _dense_columns(x_ptr, w_ptr + e * N * K, n, nm, K, BN, GB * 32, OPERAND)
        return y

    @triton.jit
    def _silu_times(gate, up):
        """silu(gate) * up in float32, the division correctly rounded as torch's F.silu's."""
        return tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _gate_up_rows(x_ptr, ids_ptr, w_ptr, sm_ptr, act_ptr, F, K, n_groups, stride_x, TOPK: tl.constexpr,
                      FMT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, GB: tl.constexpr,
                      OPERAND: tl.constexpr, PREFETCH: tl.constexpr, DEPENDENT: tl.constexpr):
        """One (row, slot) pair p and F-column tile: act[p] = silu(gate) * up of the pair's expert."""
        dependent_start(DEPENDENT)
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < F
        e = tl.load(ids_ptr + p).to(tl.int64)
        x = x_ptr + (p // TOPK) * stride_x
        gate = _expert_columns(x, w_ptr, sm_ptr, e, n, nm, 2 * F, K, n_groups, FMT, G, BN, GB, OPERAND, PREFETCH)
        up = _expert_columns(x, w_ptr, sm_ptr, e, n + F, nm, 2 * F, K, n_groups, FMT, G, BN, GB, OPERAND, PREFETCH)
        tl.store(act_ptr + p * F + n, _silu_times(gate, up), mask=nm)

    @triton.jit
    def _slot_down(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, p, n, nm, D, F, n_groups, FMT: tl.constexpr,
                   G: tl.constexpr, BN: tl.constexpr, GB: tl.constexpr, OPERAND: tl.constexpr,
                   PREFETCH: tl.constexpr):
        """[BN] float32: weight_p * down_p(act[p]) at columns n, for the (row, slot) pair p."""
        e = tl.load(ids_ptr + p).to(tl.int64)
        weight = tl.load(wt_ptr + p)
        return weight * _expert_columns(act_ptr + p * F, w_ptr, sm_ptr, e, n, nm, D, F, n_groups, FMT, G, BN, GB,
                                        OPERAND, PREFETCH)

    @triton.jit
    def _down_rows(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, out_ptr, D, F, n_groups, TOPK: tl.constexpr,
                   ADD: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                   GB: tl.constexpr, OPERAND: tl.constexpr, PREFETCH: tl.constexpr, DEPENDENT: tl.constexpr):
        """One row t and D-column tile: out[t] (+)= sum over its slots j, in order, of
        weight_j * down_j(act[t * TOPK + j])."""
        dependent_start(DEPENDENT)
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < D
        y = tl.zeros([BN], tl.float32)
        for j in range(TOPK):
            y += _slot_down(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, t * TOPK + j, n, nm, D, F, n_groups, FMT,
                            G, BN, GB, OPERAND, PREFETCH)
        out = out_ptr + t * D + n
        if ADD:  # the residual stream, updated in place after the row's own sum
            y += tl.load(out, mask=nm, other=0.0)
        tl.store(out, y, mask=nm)

    @triton.jit
    def _down_pairs(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, part_ptr, D, F, n_groups, FMT: tl.constexpr,
                    G: tl.constexpr, BN: tl.constexpr, GB: tl.constexpr, OPERAND: tl.constexpr,
                    PREFETCH: tl.constexpr, DEPENDENT: tl.constexpr):
        """One (row, slot) pair p and D-column tile: part[p] = weight_p * down_p(act[p]); `_sum_slots`
        then adds a row's slots in order."""
        dependent_start(DEPENDENT)
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < D
        y = _slot_down(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, p, n, nm, D, F, n_groups, FMT, G, BN, GB, OPERAND,
                       PREFETCH)
        tl.store(part_ptr + p * D + n, y, mask=nm)

    @triton.jit
    def _matrix_rows(x_ptr, w_ptr, sm_ptr, out_ptr, E, N, K, n_groups, stride_xt, stride_xe, stride_ot, stride_oe,
                     FMT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, GB: tl.constexpr,
                     OPERAND: tl.constexpr, PREFETCH: tl.constexpr, DEPENDENT: tl.constexpr):
        """One (row t, matrix e) pair and N-column tile: out[t, e] = matrix e times x[t, e]."""
        dependent_start(DEPENDENT)
        p = tl.program_id(0)
        t = p // E
        e = p % E
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        y = _expert_columns(x_ptr + t * stride_xt + e * stride_xe, w_ptr, sm_ptr, e.to(tl.int64), n, nm, N, K,
                            n_groups, FMT, G, BN, GB, OPERAND, PREFETCH)
        tl.store(out_ptr + t * stride_ot + e * stride_oe + n, y, mask=nm)

    @triton.jit
    def _align(ids_ptr, sorted_ptr, owner_ptr, P, E, n_blocks, BM: tl.constexpr, EB: tl.constexpr,
               PB: tl.constexpr, NB: tl.constexpr, DEPENDENT: tl.constexpr):
        """One program: the pairs 0..P-1 (expert ids at ids_ptr) grouped by expert.  Expert e's
        pairs, in pair order, go to sorted[start_e ..], start_e the sum of the earlier experts'
        counts each rounded up to BM (the slots between hold P: no pair); owner[b] is the expert
        of block b, -1 past the last."""
        dependent_start(DEPENDENT)
        for c in range(0, n_blocks * BM, NB * BM):
            i = c + tl.arange(0, NB * BM)
            tl.store(sorted_ptr + i, tl.zeros([NB * BM], tl.int32) + P, mask=i < n_blocks * BM)
        tl.debug_barrier()  # every slot holds P before the pairs overwrite theirs
        experts = tl.arange(0, EB)
        counts = tl.zeros([EB], tl.int32)
        for c in range(0, P, PB):
            i = c + tl.arange(0, PB)
            ids = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        starts = ends - padded
        seen = tl.zeros([EB], tl.int32)
        for c in range(0, P, PB):
            i = c + tl.arange(0, PB)
            ids = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
            hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [PB, EB]
            rank = tl.cumsum(hit, 0) - 1 + seen[None, :]  # among the expert's earlier pairs
            where = tl.sum(hit * (starts[None, :] + rank), axis=1)
            tl.store(sorted_ptr + where, i, mask=i < P)
            seen += tl.sum(hit, axis=0)
        real = experts < E
        for b0 in range(0, n_blocks, NB):
            b = b0 + tl.arange(0, NB)
            # the block's expert: the number of experts that end at or before its first slot
            owner = tl.sum(((ends[None, :] <= (b * BM)[:, None]) & real[None, :]).to(tl.int32), axis=1)
            tl.store(owner_ptr + b, tl.where(owner < E, owner, -1), mask=b < n_blocks)

    @triton.jit
    def _expert_group(w_ptr, sm_ptr, e, n, nm, g, N, K, n_groups, FMT: tl.constexpr, G: tl.constexpr,
                      OPERAND: tl.constexpr):
        """Group g of columns n of expert e: the weights as OPERAND values [BN, G] and each
        column's scale and minimum [BN] float32 (ones and zeros for a bfloat16 stack)."""
        if FMT == 0:
            w, scale, minimum = group_weights(w_ptr + e * N * (K // 2), sm_ptr + e * n_groups * N * 2, n, nm, g, N,
                                              K, OPERAND)
        else:
            kk = g * G + tl.arange(0, G)
            w = tl.load(w_ptr + e * N * K + n[:, None] * K + kk[None, :], mask=nm[:, None], other=0).to(OPERAND)
            if FMT == 1:  # int8 values are exact in bfloat16
                pair = sm_ptr + e * n_groups * N * 2 + (g * N + n) * 2
                scale = tl.load(pair, mask=nm, other=0.0).to(tl.float32)
                minimum = tl.load(pair + 1, mask=nm, other=0.0).to(tl.float32)
            else:
                scale = tl.full(n.shape, 1.0, tl.float32)
                minimum = tl.zeros(n.shape, tl.float32)
        return w, scale, minimum

    @triton.jit
    def _block_product(x_ptr, w_ptr, sm_ptr, e, m, n, mm, nm, g, N, K, n_groups, stride_x, acc, FMT: tl.constexpr,
                       G: tl.constexpr, OPERAND: tl.constexpr):
        """acc, the [BM, BN] tile of rows m (of x) and columns n of expert e (format FMT, groups
        of G), with group g's contribution added."""
        if FMT == 0:
            y = group_product(x_ptr, w_ptr + e * N * (K // 2), sm_ptr + e * n_groups * N * 2, m, n, mm, nm, g,
                              N, K, stride_x, acc, OPERAND)
        else:
            w, scale, minimum = _expert_group(w_ptr, sm_ptr, e, n, nm, g, N, K, n_groups, FMT, G, OPERAND)
            x = tl.load(x_ptr + m[:, None] * stride_x + (g * G + tl.arange(0, G))[None, :], mask=mm[:, None],
                        other=0.0).to(OPERAND)
            y = tl.dot(x, tl.trans(w))
            if FMT == 1:
                y = add_group(acc, y, scale[None, :], tl.sum(x.to(tl.float32), axis=1)[:, None], minimum[None, :])
            else:
                y += acc
        return y

    @triton.jit
    def _group_inputs_t(x_ptr, m, mm, g, stride_x, BN: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
                        OPERAND: tl.constexpr):
        """Group g of rows m as the second operand [G, BM] of a transposed tile, and their sums laid
        out as that tile [BN, BM] (engine.cuda_int4.group_product_t's ones times x; zeros for a
        bfloat16 stack, which has no minimums)."""
        x = tl.load(x_ptr + m[None, :] * stride_x + (g * G + tl.arange(0, G))[:, None], mask=mm[None, :],
                    other=0.0).to(OPERAND)
        if FMT == 2:
            xsum = tl.zeros([BN, x.shape[1]], tl.float32)
        else:
            xsum = tl.dot(tl.full([BN, G], 1.0, OPERAND), x)
        return x, xsum

    @triton.jit
    def _block_product_t(w_ptr, sm_ptr, e, n, nm, g, N, K, n_groups, x, xsum, acc, FMT: tl.constexpr,
                         G: tl.constexpr, OPERAND: tl.constexpr):
        """_block_product transposed: acc [BN, BM] (columns n by the rows of x), the same sums,
        the weights the tensor cores' first operand, which they read from registers; x and
        xsum from `_group_inputs_t`, shared by a block's gate and up tiles."""
        w, scale, minimum = _expert_group(w_ptr, sm_ptr, e, n, nm, g, N, K, n_groups, FMT, G, OPERAND)
        y = tl.dot(w, x)  # exact products, float32 sums
        if FMT == 2:
            y += acc
        else:
            y = add_group(acc, y, scale[:, None], xsum, minimum[:, None])
        return y

    @triton.jit
    def _tile(m, n, TRANSPOSED: tl.constexpr):
        """Row indices m and column indices n broadcast to a tile of the order TRANSPOSED picks
        ([BN, BM] or [BM, BN])."""
        if TRANSPOSED:
            rows, columns = m[None, :], n[:, None]
        else:
            rows, columns = m[:, None], n[None, :]
        return rows, columns

    @triton.jit
    def _gate_up_blocks(x_ptr, sorted_ptr, owner_ptr, w_ptr, sm_ptr, act_ptr, P, F, K, n_groups, stride_x,
                        TOPK: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        UNROLL: tl.constexpr, OPERAND: tl.constexpr, TRANSPOSED: tl.constexpr,
                        DEPENDENT: tl.constexpr):
        """One block of one expert's pairs and F-column tile: act[pair] = silu(gate) * up.  UNROLL
        groups (a divisor of n_groups) per loop step, in order, their loads in flight together;
        TRANSPOSED: the tiles computed columns by rows (`_block_product_t`)."""
        dependent_start(DEPENDENT)
        e = tl.load(owner_ptr + tl.program_id(0))
        if e < 0:
            return
        e = e.to(tl.int64)
        pair = tl.load(sorted_ptr + tl.program_id(0) * BM + tl.arange(0, BM))
        pm = pair < P
        rows = pair // TOPK
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < F
        if TRANSPOSED:
            gate = tl.zeros([BN, BM], tl.float32)
        else:
            gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros_like(gate)
        for c in range(0, n_groups // UNROLL):
            for u in tl.static_range(UNROLL):
                g = c * UNROLL + u
                if TRANSPOSED:  # one load of the block's activations for both
                    x, xsum = _group_inputs_t(x_ptr, rows, pm, g, stride_x, BN, FMT, G, OPERAND)
                    gate = _block_product_t(w_ptr, sm_ptr, e, n, nm, g, 2 * F, K, n_groups, x, xsum, gate, FMT, G,
                                            OPERAND)
                    up = _block_product_t(w_ptr, sm_ptr, e, n + F, nm, g, 2 * F, K, n_groups, x, xsum, up, FMT, G,
                                          OPERAND)
                else:
                    gate = _block_product(x_ptr, w_ptr, sm_ptr, e, rows, n, pm, nm, g, 2 * F, K, n_groups,
                                          stride_x, gate, FMT, G, OPERAND)
                    up = _block_product(x_ptr, w_ptr, sm_ptr, e, rows, n + F, pm, nm, g, 2 * F, K, n_groups,
                                        stride_x, up, FMT, G, OPERAND)
        tm, tn = _tile(pair, n, TRANSPOSED)
        tmm, tnm = _tile(pm, nm, TRANSPOSED)
        tl.store(act_ptr + tm * F + tn, _silu_times(gate, up), mask=tmm & tnm)

    @triton.jit
    def _down_blocks(act_ptr, sorted_ptr, owner_ptr, wt_ptr, w_ptr, sm_ptr, part_ptr, P, D, F, n_groups,
                     FMT: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UNROLL: tl.constexpr,
                     OPERAND: tl.constexpr, TRANSPOSED: tl.constexpr, DEPENDENT: tl.constexpr):
        """One block and D-column tile: part[pair] = weight[pair] * down(act[pair]) (UNROLL and
        TRANSPOSED as `_gate_up_blocks`)."""
        dependent_start(DEPENDENT)
        e = tl.load(owner_ptr + tl.program_id(0))
        if e < 0:
            return
        e = e.to(tl.int64)
        pair = tl.load(sorted_ptr + tl.program_id(0) * BM + tl.arange(0, BM))
        pm = pair < P
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < D
        if TRANSPOSED:
            acc = tl.zeros([BN, BM], tl.float32)
        else:
            acc = tl.zeros([BM, BN], tl.float32)
        for c in range(0, n_groups // UNROLL):
            for u in tl.static_range(UNROLL):
                g = c * UNROLL + u
                if TRANSPOSED:
                    x, xsum = _group_inputs_t(act_ptr, pair, pm, g, F, BN, FMT, G, OPERAND)
                    acc = _block_product_t(w_ptr, sm_ptr, e, n, nm, g, D, F, n_groups, x, xsum, acc, FMT, G, OPERAND)
                else:
                    acc = _block_product(act_ptr, w_ptr, sm_ptr, e, pair, n, pm, nm, g, D, F, n_groups, F, acc, FMT,
                                         G, OPERAND)
        tm, tn = _tile(pair, n, TRANSPOSED)
        tmm, tnm = _tile(pm, nm, TRANSPOSED)
        weight = tl.load(wt_ptr + tm, mask=tmm, other=0.0)
        tl.store(part_ptr + tm * D + tn, acc * weight, mask=tmm & tnm)

    @triton.jit
    def _sum_slots(part_ptr, out_ptr, D, TOPK: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr,
                   DEPENDENT: tl.constexpr):
        """out[t] (+)= part[t * TOPK] + part[t * TOPK + 1] + ..., in slot order."""
        dependent_start(DEPENDENT)
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nm = n < D
        y = tl.load(part_ptr + t * TOPK * D + n, mask=nm, other=0.0)
        for j in range(1, TOPK):
            y += tl.load(part_ptr + (t * TOPK + j) * D + n, mask=nm, other=0.0)
        if ADD:
            y += tl.load(out_ptr + t * D + n, mask=nm, other=0.0)
        tl.store(out_ptr + t * D + n, y, mask=nm)


if AVAILABLE:
    @triton.jit
    def _route_softmax(scores_ptr, ids_ptr, wt_ptr, E, stride, K: tl.constexpr, EB: tl.constexpr,
                       RENORMALISE: tl.constexpr, DEPENDENT: tl.constexpr):
        """One row: softmax over its E scores, the K most probable experts (of equal ones the lower
        index first, as torch's stable sort orders them), their probabilities, renormalised to
        sum to one if asked."""
        dependent_start(DEPENDENT)
        t = tl.program_id(0)
        e = tl.arange(0, EB)
        x = tl.load(scores_ptr + t * stride + e, mask=e < E, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        # Two passes over the same choices: the first sums the chosen probabilities (in slot
        # order), the second writes them; a taken expert is marked below every probability.
        left = tl.where(e < E, p, -1.0)
        total = 0.0
        for j in tl.static_range(K):
            best = tl.argmax(left, axis=0, tie_break_left=True)
            total += tl.sum(tl.where(e == best, p, 0.0), axis=0)
            left = tl.where(e == best, -2.0, left)
        left = tl.where(e < E, p, -1.0)
        for j in tl.static_range(K):
            best = tl.argmax(left, axis=0, tie_break_left=True)
            w = tl.sum(tl.where(e == best, p, 0.0), axis=0)
            if RENORMALISE:
                w = w / total
            tl.store(ids_ptr + t * K + j, best.to(tl.int64))
            tl.store(wt_ptr + t * K + j, w)
            left = tl.where(e == best, -2.0, left)


def route_softmax(scores: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.models.qwen_moe.route on the device in one kernel: scores [T, n_expert] float32
    (rows may be strided) -> (expert ids int64 [T, k], float32 weights [T, k]), both contiguous.
    The softmax and the renormalising sum are summed in another order than torch's."""
    T, E = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    ids = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=scores.device)
    _route_softmax[(T,)](scores, ids, weights, E, scores.stride(0), K=k, EB=triton.next_power_of_2(E),
                         RENORMALISE=renormalise, num_warps=4, **_dependent(scores.device, T))
    return ids, weights


if AVAILABLE:
    @triton.jit
    def _take_best(left, e, K: tl.constexpr, KP: tl.constexpr):
        """The indices `e` of the K largest of `left`, in order (of equal ones the lower index
        first), as a [KP]-long int32 vector (KP: K rounded up to a power of two; the rest -1).
        Padding entries of `left` must hold -inf."""
        slots = tl.arange(0, KP)
        taken = tl.full([KP], -1, tl.int32)
        for j in tl.static_range(K):
            best = tl.argmax(left, axis=0, tie_break_left=True)
            taken = tl.where(slots == j, best, taken)
            left = tl.where(e == best, -float("inf"), left)
        return taken

    @triton.jit
    def _route_grouped(scores_ptr, bias_ptr, ids_ptr, wt_ptr, E, stride, group_size, min_sum, scale,
                       K: tl.constexpr, KP: tl.constexpr, EB: tl.constexpr, SIGMOID: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NG: tl.constexpr, NG_USED: tl.constexpr,
                       NORMALISE: tl.constexpr, DEPENDENT: tl.constexpr):
        """One row, by engine.models.deepseek2.route's rule: probabilities (sigmoid or softmax),
        the bias added for the choice only, the choice limited to the NG_USED of NG groups whose
        two best biased scores sum highest (NG = 1: no groups), the K best (ties to the lower
        index), weighted by their probabilities, renormalised (the sum at least min_sum) if
        asked, times scale."""
        dependent_start(DEPENDENT)
        t = tl.program_id(0)
        e = tl.arange(0, EB)
        real = e < E
        x = tl.load(scores_ptr + t * stride + e, mask=real, other=0.0).to(tl.float32)
        if SIGMOID:
            p = 1.0 / (1.0 + tl.exp(-x))
        else:
            z = tl.exp(tl.where(real, x, -float("inf")) - tl.max(tl.where(real, x, -float("inf")), axis=0))
            p = z / tl.sum(z, axis=0)
        select = p
        if HAS_BIAS:
            select = select + tl.load(bias_ptr + e, mask=real, other=0.0).to(tl.float32)
        select = tl.where(real, select, -float("inf"))
        if NG > 1:
            g = tl.arange(0, NG)
            member = (e[None, :] // group_size) == g[:, None]  # [NG, EB]
            inside = tl.where(member, select[None, :], -float("inf"))
            first = tl.max(inside, axis=1)
            at = tl.argmax(inside, axis=1, tie_break_left=True)
            second = tl.max(tl.where(e[None, :] == at[:, None], -float("inf"), inside), axis=1)
            best = first + tl.where(group_size > 1, second, 0.0)
            kept = _take_best(best, g, NG_USED, NG)
            keep = tl.sum((g[:, None] == kept[None, :]).to(tl.int32), axis=1) > 0  # [NG]
            in_kept = tl.sum((member & keep[:, None]).to(tl.int32), axis=0) > 0  # [EB]
            select = tl.where(in_kept, select, -float("inf"))
        chosen = _take_best(select, e, K, KP)
        slots = tl.arange(0, KP)
        w = tl.sum(tl.where(e[None, :] == chosen[:, None], p[None, :], 0.0), axis=1)  # [KP]
        w = tl.where(slots < K, w, 0.0)
        if NORMALISE:
            w = w / tl.maximum(tl.sum(w, axis=0), min_sum)
        w = w * scale
        tl.store(ids_ptr + t * K + slots, chosen.to(tl.int64), mask=slots < K)
        tl.store(wt_ptr + t * K + slots, w, mask=slots < K)


def route_grouped(scores: torch.Tensor, k: int, gating: str, bias: torch.Tensor | None = None, n_groups: int = 0,
                  n_groups_used: int = 0, normalise: bool = False, scale: float = 1.0,
                  min_sum: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.models.deepseek2.route on the device in one kernel (its arguments; `min_sum` the
    floor of a renormalising sum): scores [T, n_expert] -> (ids int64 [T, k], float32 weights
    [T, k]), both contiguous.  Sums run in another order than torch's."""
    if gating not in ("softmax", "sigmoid"):
        raise ValueError(f"no routing kernel for gating {gating!r}")
    T, E = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    grouped = n_groups > 1 and n_groups_used < n_groups
    ng = triton.next_power_of_2(n_groups) if grouped else 1
    ids = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=scores.device)
    _route_grouped[(T,)](scores, scores if bias is None else bias, ids, weights, E, scores.stride(0),
                         E // n_groups if grouped else E, min_sum, scale, K=k, KP=triton.next_power_of_2(k),
                         EB=triton.next_power_of_2(E), SIGMOID=gating == "sigmoid", HAS_BIAS=bias is not None,
                         NG=ng, NG_USED=n_groups_used if grouped else 1, NORMALISE=normalise, num_warps=4,
                         **_dependent(scores.device, T))
    return ids, weights


def matrix_products(x: torch.Tensor, stack: StackedWeight, out: torch.Tensor | None = None,
                    launch: MoeLaunch = LAUNCH) -> torch.Tensor:
    """Row t's input to matrix e times that matrix, for every row and every matrix of the stack:
    x [T, E, K] (float32 or bfloat16, each input contiguous) -> float32 [T, E, N] (into `out`
    where given: float32, each output contiguous), one indexed product per (row, matrix) with
    the experts' arithmetic and launch (deepseek2's absorbed per-head products, decoding a few
    rows).  Nothing is read back to the host."""
    T, E, K = x.shape
    if E != stack.n_expert or K != stack.k:
        raise ValueError(f"inputs [{T}, {E}, {K}] for a stack of {stack.n_expert} matrices [{stack.n}, {stack.k}]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((T, E, stack.n), dtype=torch.float32, device=x.device)
    elif out.shape != (T, E, stack.n) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"cannot write [{T}, {E}, {stack.n}] float32 products into {out.dtype} {tuple(out.shape)}")
    bn = launch.gemv_bn
    _matrix_rows[(T * E, triton.cdiv(stack.n, bn))](
        x, *stack.row_operands(), out, E, stack.n, K, stack.n_groups, x.stride(0), x.stride(1), out.stride(0),
        out.stride(1), FMT=stack.format_index, G=stack.group, BN=bn,
        GB=_groups_per_step(stack.n_groups, launch.gemv_gb), OPERAND=OPERAND, PREFETCH=launch.gemv_prefetch,
        num_warps=launch.gemv_warps, **_dependent(x.device, T))
    return out


def group_by_expert(ids: torch.Tensor, n_expert: int, bm: int,
                    dependent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, slot) pairs 0..P-1 whose experts are `ids` [P] grouped by expert on the device,
    in blocks of `bm`: (pairs int32 [max_blocks * bm], owner int32 [max_blocks]); block b holds
    pairs[b * bm: (b + 1) * bm] of expert owner[b], in pair order, padded with P (no pair);
    blocks past the last used one have owner -1.  One kernel (`dependent`: launched as a
    programmatic dependent where the device can), nothing read back."""
    dependent = dependent and dependent_launch(ids.device)
    P = ids.shape[0]
    n_blocks = max_blocks(P, n_expert, bm)
    pairs = torch.empty((n_blocks * bm,), dtype=torch.int32, device=ids.device)
    owner = torch.empty((n_blocks,), dtype=torch.int32, device=ids.device)
    eb = triton.next_power_of_2(n_expert)
    _align[(1,)](ids, pairs, owner, P, n_expert, n_blocks, BM=bm, EB=eb, PB=max(16, ALIGN_ELEMENTS // eb), NB=64,
                 num_warps=8, DEPENDENT=dependent, launch_pdl=dependent)
    return pairs, owner


def _unroll(n_groups: int, most: int) -> int:
    """Groups per loop step of the grouped GEMM: the largest power of two up to `most` that
    divides n_groups (so no step is masked)."""
    u = 1
    while u * 2 <= most and n_groups % (u * 2) == 0:
        u *= 2
    return u


def _groups_per_step(n_groups: int, most: int) -> int:
    """Groups per loop step of the indexed products: `most`, or fewer for short inputs (a
    power of two, so no step is mostly masked)."""
    return max(1, min(most, triton.next_power_of_2(n_groups)))


def _dependent(device: torch.device, rows: int) -> dict:
    """The launch arguments of a kernel here for `rows` rows: launched as a programmatic
    dependent or not (DEPENDENT_EXPERT_ROWS)."""
    dependent = rows <= DEPENDENT_EXPERT_ROWS and dependent_launch(device)
    return dict(DEPENDENT=dependent, launch_pdl=dependent)


class StackedExperts:
    """One layer's routed experts on CUDA (see the module docstring)."""

    def __init__(self, gate_up: StackedWeight, down: StackedWeight, launch: MoeLaunch = LAUNCH):
        if gate_up.n_expert != down.n_expert or gate_up.n != 2 * down.k or gate_up.k != down.n:
            raise ValueError(f"gate/up [{gate_up.n_expert}, {gate_up.n}, {gate_up.k}] and down "
                             f"[{down.n_expert}, {down.n}, {down.k}] do not make one SwiGLU")
        self.gate_up, self.down = gate_up, down
        self.n_expert, self.n_ff, self.n_embd = down.n_expert, down.k, down.n
        self.launch = launch

    @classmethod
    def build(cls, gate: TensorRecord, up: TensorRecord, down: TensorRecord, device: torch.device) -> "StackedExperts":
        """From a layer's 3-D ffn_gate_exps, ffn_up_exps and ffn_down_exps records."""
        return cls(StackedWeight([gate, up], device), StackedWeight([down], device))

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        T, k = ids.shape
        if h.stride(-1) != 1:
            h = h.contiguous()
        ids = ids.reshape(-1).contiguous()
        weights = weights.reshape(-1).float().contiguous()
        add = into is not None
        if add and not (into.dtype == torch.float32 and into.shape == (T, self.n_embd) and into.is_contiguous()):
            into += self(h, ids.view(T, k), weights.view(T, k))
            return into
        out = into if add else torch.empty((T, self.n_embd), dtype=torch.float32, device=h.device)
        if T <= GEMV_MAX_ROWS:
            act = torch.empty((T * k, self.n_ff), dtype=torch.float32, device=h.device)
            self._rows(h, ids, weights, act, out, k, add)
        else:
            # The grouped GEMM rounds its inputs to the tensor cores' operand as it reads them:
            # stored so (gemm_narrow_act; gemm_narrow_input for the gate/up product's), a
            # product reads half the bytes and they go to shared memory as they are, the same
            # values.
            narrow = self.launch.gemm_narrow_act and OPERAND == tl.bfloat16
            act = torch.empty((T * k, self.n_ff), dtype=torch.bfloat16 if narrow else torch.float32, device=h.device)
            self._blocks(h, ids, weights, act, out, k, add)
        return out

    def _rows(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: torch.Tensor,
              out: torch.Tensor, k: int, add: bool) -> None:
        cfg, gu, dn = self.launch, self.gate_up, self.down
        T, F, D = h.shape[0], self.n_ff, self.n_embd
        bn = cfg.gemv_bn
        launch = dict(OPERAND=OPERAND, PREFETCH=cfg.gemv_prefetch, num_warps=cfg.gemv_warps, **_dependent(h.device, T))
        _gate_up_rows[(T * k, triton.cdiv(F, bn))](
            h, ids, *gu.row_operands(), act, F, gu.k, gu.n_groups, h.stride(0), TOPK=k, FMT=gu.format_index,
            G=gu.group, BN=bn, GB=_groups_per_step(gu.n_groups, cfg.gemv_gb), **launch)
        shape = dict(FMT=dn.format_index, G=dn.group, BN=bn, GB=_groups_per_step(dn.n_groups, cfg.gemv_gb), **launch)
        if cfg.gemv_down == "pairs":
            part = torch.empty((T * k, D), dtype=torch.float32, device=h.device)
            _down_pairs[(T * k, triton.cdiv(D, bn))](act, ids, weights, *dn.row_operands(), part, D, F,
                                                     dn.n_groups, **shape)
            self._sum_slots(part, out, k, add)
        else:
            _down_rows[(T, triton.cdiv(D, bn))](act, ids, weights, *dn.row_operands(), out, D, F, dn.n_groups,
                                                TOPK=k, ADD=add, **shape)

    @staticmethod
    def _sum_slots(part: torch.Tensor, out: torch.Tensor, k: int, add: bool) -> None:
        """out (+)= each row's k slots of `part` [T * k, D], added in slot order."""
        T, D = out.shape
        block = min(1024, triton.next_power_of_2(D))
        _sum_slots[(T, triton.cdiv(D, block))](part, out, D, TOPK=k, ADD=add, BLOCK=block, num_warps=4,
                                               **_dependent(out.device, T))

    def _blocks(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: torch.Tensor,
                out: torch.Tensor, k: int, add: bool) -> None:
        cfg, gu, dn = self.launch, self.gate_up, self.down
        T, F, D, E = h.shape[0], self.n_ff, self.n_embd, self.n_expert
        P = T * k
        bm = block_m(P, E)
        pairs, owner = group_by_expert(ids, E, bm, dependent=T <= DEPENDENT_EXPERT_ROWS)
        n_blocks = owner.shape[0]
        bn = cfg.gemm_bn
        shape = dict(BM=bm, BN=bn, OPERAND=OPERAND, TRANSPOSED=bm <= cfg.gemm_transposed_bm,
                     num_warps=cfg.gemm_warps, num_stages=cfg.gemm_stages, **_dependent(h.device, T))
        x = h.to(torch.bfloat16) if cfg.gemm_narrow_input and OPERAND == tl.bfloat16 else h
        _gate_up_blocks[(n_blocks, triton.cdiv(F, bn))](
            x, pairs, owner, *gu.block_operands(), act, P, F, gu.k, gu.n_groups, x.stride(0), TOPK=k,
            FMT=gu.format_index, G=gu.group, UNROLL=_unroll(gu.n_groups, cfg.gemm_unroll), **shape)
        part = torch.empty((P, D), dtype=torch.float32, device=h.device)
        _down_blocks[(n_blocks, triton.cdiv(D, bn))](
            act, pairs, owner, weights, *dn.block_operands(), part, P, D, F, dn.n_groups, FMT=dn.format_index,
            G=dn.group, UNROLL=_unroll(dn.n_groups, cfg.gemm_unroll), **shape)
        self._sum_slots(part, out, k, add)
