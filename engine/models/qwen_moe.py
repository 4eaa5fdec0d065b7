"""The Qwen mixture-of-experts family: qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B) and qwen2moe
(Qwen1.5-MoE, Qwen2-57B-A14B).

Attention is the llama family's (engine.models.llama: grouped-query attention with neox rope,
qwen3moe's per-head q/k RMSNorm, qwen2moe's q/k/v bias), so `QwenMoeModel` is a `LlamaModel`
whose blocks replace the dense FFN by a mixture of experts, with llama.cpp's conventions:

- the router `ffn_gate_inp` [n_expert, n_embd] scores the normed residual; the scores go
  through a softmax over all experts, and each token takes the `expert_used_count` experts of
  the highest probability (ties to the lower index), weighted by their probabilities;
- qwen3moe renormalises those weights to sum to one (its checkpoints' norm_topk_prob),
  qwen2moe does not; `{arch}.expert_weights_norm`, where a file states it, wins;
- every expert is a SwiGLU of width `expert_feed_forward_length`, stored stacked in the 3-D
  tensors `ffn_gate_exps`, `ffn_up_exps` [n_expert, n_ff_exp, n_embd] and `ffn_down_exps`
  [n_expert, n_embd, n_ff_exp]; the token's output is the weighted sum of its experts';
- qwen2moe adds a shared expert (`ffn_gate_shexp`, `ffn_up_shexp`, `ffn_down_shexp`, width
  `expert_shared_feed_forward_length`) that every token runs, scaled by the sigmoid of
  `ffn_gate_inp_shexp` [n_embd] applied to the same normed residual.

The router and the shared-expert gate stay float32 (llama.cpp's quantizer keeps
`ffn_gate_inp` in F32, and a routing decision should not flip on a rounding of the weights):
one float32 matrix computed one row at a time, so a row's scores never depend on the batch.
On CPU (and on CUDA in float32 or without Triton) each expert's gate/up and down are ordinary
engine.weights Linear ops (the stacked tensor is split into per-expert views of the file's
bytes, so packed types stay packed), and a step runs only the experts its rows were routed
to, each once over the rows routed to it.  On CPU (`add_experts_cpu`) an expert's SwiGLU is the
compiled kernels' fused op, its hidden activations are scaled by the rows' routing weights, and
its down-projection adds into the residual rows itself (the int4 kernels' fused add), experts
in ascending id, then the shared expert; elsewhere (`mix_experts`) a row adds its experts'
weighted outputs in its own top-k order.  The kernels' results for a row do not depend on the
other rows (engine.weights), so on CPU a row decoded in a batch, alone or as part of a prefill
chunk computes the same bits (up to the `amx` tile kernel's caveat for an expert that gets 32
rows or more, as for every matmul).  These paths read the routing decision back to the host to
group the rows.

On CUDA with packed weights (`stacks_experts`) a layer's experts are instead held stacked and
run by engine.cuda_moe's kernels, which read each row's experts from the device: routing,
experts and the sum into the residual stream never wait for the host, so decoding steps are
captured in CUDA graphs (engine.cuda_graphs) like the dense families'.  That path's FFN norm
is one float32 kernel in eager steps and graphs alike, so both route on the same scores.

The weight accounting counts every expert (all of them are resident), the routers and the
shared expert.  `Expert`, `swiglu_expert`, `stacked_experts`, `routed_experts`,
`experts_nbytes`, `float32_rows` and the dispatches `add_experts_cpu` and `mix_experts` are
public for the other mixture-of-experts families (engine.models.deepseek2).  The module
implements `engine.protocols.Network` through `LlamaModel`; it is registered for qwen2moe and
qwen3moe in engine.models.ARCHITECTURES.  It reads no files and knows nothing of tokens' text
or sessions.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from engine import cuda_elementwise, cuda_moe
from engine.config import ModelConfig, UnsupportedModel
from engine.gguf_file import GGUFContents, TensorRecord
from engine.kernels import CpuKernels
from engine.models.llama import Block, LlamaModel, StepKernels
from engine.weights import DenseLinear, Linear, RowByRow, build_linear, split_experts, to_float

# Whether a family renormalises its top-k routing weights when the file does not say.
RENORMALISE_TOP_K = {"qwen3moe": True, "qwen2moe": False}


@dataclass(frozen=True)
class Expert:
    """One SwiGLU FFN: gate and up fused into one matrix (gate's rows first), and down.  `swiglu`
    is a fused silu(gate) * up of float32 rows (the CPU kernels' or a CUDA kernel; None: torch's
    ops)."""

    gate_up: Linear
    down: Linear
    swiglu: Callable[[torch.Tensor], torch.Tensor] | None = None

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """[n, n_embd] -> float32 [n, width]: silu(gate) * up."""
        gu = self.gate_up(h).float()
        if self.swiglu is not None and gu.stride(-1) == 1:
            return self.swiglu(gu)
        width = gu.shape[1] // 2
        return F.silu(gu[:, :width]) * gu[:, width:]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[n, n_embd] -> float32 [n, n_embd]."""
        return self.down(self.hidden(h)).float()

    def add_to(self, out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """out += down(hidden(h) * scale) for float32 `out` [n, n_embd] and per-row `scale` [n, 1]
        (None: 1), the down-projection adding into `out` itself where its kernel can."""
        a = self.hidden(h)
        self.down.accumulate(out, a if scale is None else a * scale)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def swiglu_expert(gate: TensorRecord, up: TensorRecord, down: TensorRecord, fmt: str, device: torch.device,
                  cpu: CpuKernels | None) -> Expert:
    """An `Expert` of the three matrices, with a fused SwiGLU where there is one: the CPU
    kernels', or on CUDA engine.cuda_elementwise's (one kernel, torch's float32 arithmetic)."""
    swiglu = None
    if cpu is not None and device.type == "cpu":
        swiglu = cpu.swiglu
    elif device.type == "cuda" and cuda_moe.AVAILABLE:
        swiglu = functools.partial(cuda_elementwise.swiglu, out_dtype=torch.float32)
    return Expert(build_linear([gate, up], fmt, device, cpu=cpu), build_linear([down], fmt, device, cpu=cpu), swiglu)


def stacked_experts(t: dict[str, TensorRecord], p: str, n_expert: int, fmt: str, device: torch.device,
                    cpu: CpuKernels | None) -> list[Expert]:
    """The routed experts of layer prefix `p`, one `Expert` per slice of its 3-D tensors."""
    gate, up, down = (split_experts(t[p + f"ffn_{n}_exps.weight"]) for n in ("gate", "up", "down"))
    if not len(gate) == len(up) == len(down) == n_expert:
        raise UnsupportedModel(f"{p}ffn_*_exps hold {len(gate)}/{len(up)}/{len(down)} experts, "
                               f"the metadata says {n_expert}")
    return [swiglu_expert(g, u, d, fmt, device, cpu) for g, u, d in zip(gate, up, down)]


def stacks_experts(device: torch.device, fmt: str) -> bool:
    """Whether routed experts are held stacked for engine.cuda_moe's kernels: on CUDA with
    packed weights where Triton is present (elsewhere each expert is its own `Expert`)."""
    return device.type == "cuda" and fmt == "packed" and cuda_moe.AVAILABLE


def routed_experts(t: dict[str, TensorRecord], p: str, n_expert: int, fmt: str, device: torch.device,
                   cpu: CpuKernels | None) -> list[Expert] | cuda_moe.StackedExperts:
    """The routed experts of layer prefix `p`: one `StackedExperts` where `stacks_experts`,
    else one `Expert` per slice of the 3-D tensors (`stacked_experts`)."""
    if not stacks_experts(device, fmt):
        return stacked_experts(t, p, n_expert, fmt, device, cpu)
    try:
        experts = cuda_moe.StackedExperts.build(*(t[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")),
                                                device)
    except ValueError as e:
        raise UnsupportedModel(f"{p}ffn_*_exps: {e}") from None
    if experts.n_expert != n_expert:
        raise UnsupportedModel(f"{p}ffn_*_exps hold {experts.n_expert} experts, the metadata says {n_expert}")
    return experts


def experts_nbytes(experts: list[Expert] | cuda_moe.StackedExperts) -> int:
    """Bytes held by a layer's routed experts, either form."""
    if isinstance(experts, cuda_moe.StackedExperts):
        return experts.nbytes
    return sum(e.nbytes for e in experts)


def ffn_input(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The stacked path's FFN norm (CUDA): one kernel, float32 out, so that the router scores
    the same values in eager steps and in captured graphs (whose fused norms write bfloat16)."""
    return cuda_elementwise.rms_norm(x, weight, eps, torch.float32)


def float32_rows(w: np.ndarray, device: torch.device) -> Linear:
    """A float32 matrix whose result for a row does not depend on the other rows: on CPU
    computed one row at a time (torch's float32 GEMM blocks by the number of rows)."""
    dense = DenseLinear(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(device))
    return RowByRow(dense) if device.type == "cpu" else dense


class MoeBlock(Block):
    """A llama block whose FFN is a routed mixture of experts, with qwen2moe's shared expert
    where the file has one."""

    def build_ffn(self, cfg: ModelConfig, t: dict[str, TensorRecord], p: str, fmt: str, device: torch.device,
                  cpu: CpuKernels | None) -> None:
        if not 0 < cfg.n_expert_used <= cfg.n_expert:
            raise UnsupportedModel(f"{cfg.n_expert_used} experts used of {cfg.n_expert}")
        self.experts = routed_experts(t, p, cfg.n_expert, fmt, device, cpu)
        router = to_float(t[p + "ffn_gate_inp.weight"]).reshape(cfg.n_expert, cfg.n_embd)
        self.shared: Expert | None = None
        if p + "ffn_up_shexp.weight" in t:
            self.shared = swiglu_expert(t[p + "ffn_gate_shexp.weight"], t[p + "ffn_up_shexp.weight"],
                                        t[p + "ffn_down_shexp.weight"], fmt, device, cpu)
            # The shared expert's gate rides along as one more router row.
            gate = to_float(t[p + "ffn_gate_inp_shexp.weight"]).reshape(1, cfg.n_embd)
            router = np.concatenate([router, gate])
        self.router = float32_rows(router, device)

    @property
    def ffn_bytes(self) -> int:
        shared = 0 if self.shared is None else self.shared.nbytes
        return experts_nbytes(self.experts) + self.router.nbytes + shared


def route(scores: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores [T, n_expert] -> (expert ids [T, k], float32 weights [T, k]): softmax over
    all experts, the k most probable (of equal ones the lower index first), their probabilities
    renormalised to sum to one if asked."""
    probs = torch.softmax(scores.float(), dim=-1)
    # A stable sort, not topk: topk's order among equal probabilities is unspecified.
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def add_experts_cpu(experts: list[Expert], x: torch.Tensor, h: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> None:
    """CPU: x [T, n_embd] += each row's experts `ids` [T, k] of its `h` row, weighted by
    `weights` [T, k].  Each routed expert runs once over the rows routed to it: its hidden
    activations times the rows' weights, then its down-projection added into those rows of x
    (into x itself when every row chose it, as in one-row decoding; else into a gathered copy
    written back).  A row's experts are added in ascending expert id, each its own step, so a
    row's result depends on its routing alone, not on the other rows (given row-independent
    kernels); the routing is grouped on the host in a Python loop over the T * k slots,
    cheaper than tensor operations for a decoding step's handful."""
    T, k = ids.shape
    groups: dict[int, list[int]] = {}  # expert -> its (row, choice) slots row * k + choice, rows ascending
    for slot, e in enumerate(ids.reshape(-1).tolist()):
        groups.setdefault(e, []).append(slot)
    scale = weights.reshape(-1, 1)
    for e in sorted(groups):
        slots = groups[e]
        if len(slots) == T:  # every row, in order: no gather
            picked = scale[slots[0]: slots[0] + 1] if T == 1 else scale[slots]
            experts[e].add_to(x, h, picked)
            continue
        rows = torch.tensor([slot // k for slot in slots])
        part = x.index_select(0, rows)
        experts[e].add_to(part, h.index_select(0, rows), scale[slots])
        x.index_copy_(0, rows, part)


def mix_experts(experts: list[Expert], h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 [T, n_embd]: each row's experts `ids` [T, k] applied to its `h` row and summed
    with `weights` [T, k] in its top-k order.  Each routed expert runs once, over the rows
    routed to it, so a row's result does not depend on the other rows (given row-independent
    expert kernels); the routing is read back to the host once to group the rows."""
    T, k = ids.shape
    outs = torch.empty(T, k, h.shape[1], dtype=torch.float32, device=h.device)
    flat = ids.reshape(-1).cpu()  # the step's one read-back of the routing to the host
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    at = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[at: at + n].to(h.device)  # (row, choice) pairs as row * k + choice
        at += n
        rows = torch.div(slots, k, rounding_mode="floor")
        outs.view(T * k, -1)[slots] = experts[e](h[rows])
    outs *= weights.unsqueeze(-1)
    acc = outs[:, 0]
    for j in range(1, k):
        acc = acc + outs[:, j]
    return acc


class QwenMoeModel(LlamaModel):
    block_class = MoeBlock
    captures_graphs = False  # per model: True where the experts are stacked (no read-back)
    dense_ffn = False  # the experts: its own feed_forward

    def __init__(self, cfg: ModelConfig, gguf: GGUFContents, fmt: str, device: torch.device,
                 cpu_kernels: CpuKernels | None = None):
        # The experts' widths come from their tensors' shapes; the counts must be stated.
        if cfg.n_expert <= 0 or cfg.n_expert_used <= 0:
            raise UnsupportedModel(f"{cfg.arch} without expert_count or expert_used_count in its metadata")
        norm = cfg.expert_weights_norm
        self.renormalise = RENORMALISE_TOP_K[cfg.arch] if norm is None else norm
        self.captures_graphs = stacks_experts(device, fmt)
        super().__init__(cfg, gguf, fmt, device, cpu_kernels)

    def feed_forward(self, blk: MoeBlock, x: torch.Tensor, ops: StepKernels) -> None:
        """x += the block's mixture of experts of x: each routed expert runs once, over the
        rows routed to it; each row sums its experts' weighted outputs in its top-k order."""
        if isinstance(blk.experts, cuda_moe.StackedExperts):
            self.feed_forward_stacked(blk, x)
            return
        cfg = self.cfg
        h = ops.norm(x, blk.ffn_norm)
        scores = blk.router(h).float()
        ids, weights = route(scores[:, : cfg.n_expert], cfg.n_expert_used, self.renormalise)
        if x.device.type == "cpu":
            add_experts_cpu(blk.experts, x, h, ids, weights)
            if blk.shared is not None:
                blk.shared.add_to(x, h, torch.sigmoid(scores[:, cfg.n_expert:]))
            return
        acc = mix_experts(blk.experts, h, ids, weights)
        if blk.shared is not None:
            acc = acc + torch.sigmoid(scores[:, cfg.n_expert:]) * blk.shared(h)
        x += acc

    def feed_forward_stacked(self, blk: MoeBlock, x: torch.Tensor) -> None:
        """feed_forward on CUDA with the experts stacked (engine.cuda_moe): routed on the device
        (`route`'s rule in one kernel), nothing read back, the experts' sum added into x by
        their last kernel (after the shared expert's gated output)."""
        cfg = self.cfg
        h = ffn_input(x, blk.ffn_norm, cfg.norm_eps)
        scores = blk.router(h).float()
        ids, weights = cuda_moe.route_softmax(scores[:, : cfg.n_expert], cfg.n_expert_used, self.renormalise)
        if blk.shared is not None:
            x += torch.sigmoid(scores[:, cfg.n_expert:]) * blk.shared(h)
        blk.experts(h, ids, weights, into=x)

    def work_bytes(self, n_tokens: int, ctx: int) -> int:
        """The llama estimate plus the routing buffers: the k experts' outputs of every row,
        their hidden activations and the router's scores."""
        cfg = self.cfg
        T = n_tokens
        width = cfg.n_ff_exp or cfg.n_ff
        moe = 4 * T * (cfg.n_expert_used * (cfg.n_embd + 3 * width) + cfg.n_expert + 1 + 3 * cfg.n_ff_shexp)
        return super().work_bytes(n_tokens, ctx) + moe
