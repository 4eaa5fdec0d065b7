"""Weight bytes a decoding step reads, and the tokens/s a memory bandwidth allows.

A mixture-of-experts model reads only the experts its rows were routed to, so its decoding
speed is judged against the bytes actually read, not the file's size. `step_bytes(tensors,
n_expert, n_expert_used, rows)` counts, for one decoding step of `rows` sequences:

- every layer tensor whole, except the routed experts' stacked tensors (names ending in
  `_exps.weight`), of which the expected share of distinct experts the step touches:
  rows routed uniformly at random, each to `n_expert_used` of `n_expert` distinct experts, touch
  n_expert * (1 - (1 - n_expert_used / n_expert) ** rows) experts on average per layer (one row:
  exactly n_expert_used);
- the output head whole (the embedding table when the head is tied to it), and one embedding
  row per sequence when the head is a separate matrix.

KV-cache reads, activations and norms' vectors past the weights are not counted: at short
contexts the weights dominate. `bound_tokens_per_s` is rows * bandwidth / bytes. Pure: it
takes names and sizes, not files (`from_gguf` is the thin reader).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

EXPERT_SUFFIX = "_exps.weight"


@dataclass(frozen=True)
class StepBytes:
    rows: int
    dense: int  # bytes every step reads whatever the routing (attention, routers, shared experts, head)
    experts: float  # expected bytes of routed experts read
    experts_total: int  # bytes of all routed experts (what a dense read of the file would take)

    @property
    def total(self) -> float:
        return self.dense + self.experts

    @property
    def per_token(self) -> float:
        return self.total / self.rows


def expected_experts(n_expert: int, n_expert_used: int, rows: int) -> float:
    """Distinct experts `rows` uniformly routed rows touch in one layer, on average."""
    if n_expert <= 0:
        return 0.0
    if rows == 1:
        return float(n_expert_used)
    return n_expert * (1.0 - (1.0 - n_expert_used / n_expert) ** rows)


def step_bytes(tensors: Mapping[str, int], n_expert: int, n_expert_used: int, n_vocab: int,
               rows: int = 1) -> StepBytes:
    """`tensors` maps each tensor's name to its size in bytes."""
    dense = experts = 0
    for name, nbytes in tensors.items():
        if name.endswith(EXPERT_SUFFIX):
            experts += nbytes
        elif name == "token_embd.weight":
            tied = "output.weight" not in tensors
            dense += nbytes if tied else rows * nbytes // max(1, n_vocab)
        else:
            dense += nbytes
    share = expected_experts(n_expert, n_expert_used, rows) / n_expert if n_expert else 0.0
    return StepBytes(rows, dense, experts * share, experts)


def bound_tokens_per_s(step: StepBytes, bandwidth_gb_s: float) -> float:
    """Aggregate tokens/s if every step only streamed its weights at `bandwidth_gb_s` (10^9 B/s)."""
    return step.rows * bandwidth_gb_s * 1e9 / step.total


class Unreadable(ValueError):
    """The file's tensor table or hyper-parameters cannot be read; the message says why."""


def from_gguf(path: str, rows: int = 1) -> StepBytes:
    from engine.config import ModelConfig, UnsupportedModel
    from engine.gguf_file import GGUFError, read_gguf

    try:
        contents = read_gguf(path)
        cfg = ModelConfig.from_metadata(contents.metadata)
    except (GGUFError, UnsupportedModel, ValueError) as e:
        raise Unreadable(str(e)) from None
    sizes = {name: int(t.data.nbytes) for name, t in contents.tensors.items()}
    return step_bytes(sizes, cfg.n_expert, cfg.n_expert_used, cfg.n_vocab, rows)


def describe(step: StepBytes) -> str:
    """One line, e.g. "weights read per decoding step of 1 row: 1.53 GB (routed experts 0.97 of 15.9 GB)"."""
    row = "row" if step.rows == 1 else "rows"
    text = f"weights read per decoding step of {step.rows} {row}: {step.total / 1e9:.3g} GB"
    if step.experts_total:
        text += f" (routed experts {step.experts / 1e9:.3g} of {step.experts_total / 1e9:.3g} GB)"
    return text
