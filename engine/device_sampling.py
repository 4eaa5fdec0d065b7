"""Next-token logits that stay on the GPU: only the chosen token ids cross to the host.

A CUDA decoding step ends with `StepLogits.of(rows, eos_ids)` (or, in a captured graph, the
same two argmaxes computed inside it): the greedy id of every row, plain and with the
end-of-generation ids masked, comes to the host in one small copy, and each row's logits
stay on the device.  `StepLogits.row(i)` is what a session keeps: on CPU the logits row
itself (a tensor, as before), on CUDA a `DeviceLogits` that

- answers greedy choices from the ids already on the host (`Sampler` calls `pick`),
- samples with the logit bias, temperature, top-k, top-p and min-p on the device
  (`engine.sampling`'s filters on the device row; a biased greedy choice is the argmax of the
  biased row, not the step's greedy id) with one uniform number drawn from the sampler's own CPU
  generator, inverted through the cumulative distribution: one number crosses back,
- and copies the full row to the host only when `host()` is called (`Session.logits`).

Argmax ties go to the lowest id, as in `engine.sampling`.  A seeded stream is reproducible,
but it is not the stream that `torch.multinomial` on CPU draws from the same seed.
It does not decide which rows to decode or when (see engine.batch, engine.cuda_graphs).
"""
from __future__ import annotations

import functools
from typing import Any, Protocol, runtime_checkable

import torch

from engine import cuda_elementwise
from engine.sampling import Sampler, apply_logit_bias, filtered_probs


def greedy_pair(rows: torch.Tensor, eos_index: torch.Tensor | None) -> torch.Tensor:
    """[N, 2] int64 on rows' device: each row's argmax, and its argmax with `eos_index` masked
    (on CUDA with Triton in engine.cuda_elementwise's two kernels)."""
    if rows.is_cuda and cuda_elementwise.AVAILABLE and rows.dtype == torch.float32:
        return cuda_elementwise.greedy_pair(rows, eos_index)
    plain = rows.argmax(-1)
    if eos_index is None:
        return torch.stack([plain, plain], dim=1)
    masked = rows.index_fill(1, eos_index, float("-inf")).argmax(-1)
    return torch.stack([plain, masked], dim=1)


_EOS_INDEX: dict[tuple[frozenset[int], str], torch.Tensor] = {}


def eos_tensor(eos_ids: frozenset[int], device: torch.device) -> torch.Tensor | None:
    """The ids as an index tensor on `device`, made once per set (a copy to the device per step
    would wait for the GPU)."""
    if not eos_ids:
        return None
    key = (eos_ids, str(device))
    if key not in _EOS_INDEX:
        _EOS_INDEX[key] = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    return _EOS_INDEX[key]


class DeviceLogits:
    """One row of next-token logits on the device with its greedy ids on the host."""

    __slots__ = ("row", "greedy", "greedy_no_eos", "eos_ids", "_host")

    def __init__(self, row: torch.Tensor, greedy: int, greedy_no_eos: int, eos_ids: frozenset[int]):
        self.row = row  # float32 [n_vocab] on the device
        self.greedy = greedy
        self.greedy_no_eos = greedy_no_eos  # argmax with eos_ids masked
        self.eos_ids = eos_ids
        self._host: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.row.device

    def host(self) -> torch.Tensor:
        """The row as a float32 CPU tensor (copied once, on first call)."""
        if self._host is None:
            self._host = self.row.float().cpu()
        return self._host

    def argmax(self) -> int:
        return self.greedy

    def greedy_column(self, sampler: Sampler) -> int | None:
        """Which of the step's greedy ids `sampler` draws from this row: 0 (plain argmax), 1
        (eos masked), or None where it draws otherwise (sampling, other masked ids)."""
        p = sampler.params
        if p.logit_bias:
            return None  # the step's greedy ids are of the unbiased row
        if p.argmax_ignoring_eos:
            if not sampler.eos_ids:
                return 0
            return 1 if sampler.eos_ids == self.eos_ids else None
        return 0 if p.temperature == 0.0 else None

    def pick(self, sampler: Sampler) -> int:
        """The token `sampler` draws from this row, without copying the row to the host."""
        column = self.greedy_column(sampler)
        if column is not None:
            return self.greedy_no_eos if column else self.greedy
        p = sampler.params
        row = apply_logit_bias(self.row, p.logit_bias) if p.logit_bias else self.row
        if p.argmax_ignoring_eos:  # eos ids other than the step's, or a biased row
            if not sampler.eos_ids:
                return int(row.argmax())
            banned = torch.tensor(sorted(sampler.eos_ids), dtype=torch.long, device=self.row.device)
            return int(row.index_fill(0, banned, float("-inf")).argmax())
        if p.temperature == 0.0:  # a biased row
            return int(row.argmax())
        probs = filtered_probs(row, p)
        u = torch.rand((), generator=sampler.generator, dtype=torch.float64)
        cdf = torch.cumsum(probs.double(), dim=0)
        # The first id whose cumulative mass exceeds u; zero-probability ids are never hit.
        token = torch.searchsorted(cdf, (u * cdf[-1]).to(cdf.device), right=True)
        return int(torch.clamp(token, max=probs.shape[0] - 1))


@runtime_checkable
class ColumnChooser(Protocol):
    """A token chooser other than a `Sampler` (engine.batch's `GenRequest.choose`) that can say
    which of a device row's greedy ids it will take, so that a scheduler may launch the next
    step on that id before the host has it."""

    def __call__(self, logits: Any) -> int: ...

    def greedy_column(self, logits: "DeviceLogits") -> int | None:
        """0 (plain argmax), 1 (end ids masked) or None (it chooses otherwise)."""


@functools.cache
def _names_columns(kind: type) -> bool:
    # Once per type: a runtime protocol's isinstance costs 5-10 us, and a scheduler asks for
    # every row of every step.
    return issubclass(kind, ColumnChooser)


def greedy_column(logits: Any, chooser: Any) -> int | None:
    """Which of a frontier row's greedy ids `chooser` takes (`DeviceLogits.greedy_column` for
    a `Sampler`, its own answer for a `ColumnChooser`): None where the row is on the host or
    the chooser picks by means the step's ids do not know."""
    if not isinstance(logits, DeviceLogits):
        return None
    if isinstance(chooser, Sampler):
        return logits.greedy_column(chooser)
    if _names_columns(type(chooser)):
        return chooser.greedy_column(logits)
    return None


def host_row(logits: "torch.Tensor | DeviceLogits") -> torch.Tensor:
    """A frontier row as a host-side tensor: a tensor as it is, a device row's host copy."""
    return logits.host() if isinstance(logits, DeviceLogits) else logits


class StepLogits:
    """The logits of one decoding step's N rows: a tensor [N, n_vocab] (CPU, or the device
    with `ids` [N, 2] on the host: greedy and eos-masked greedy per row)."""

    def __init__(self, rows: torch.Tensor, ids: list[list[int]] | None = None,
                 eos_ids: frozenset[int] = frozenset()):
        self.rows = rows
        self.ids = ids
        self.eos_ids = eos_ids

    @classmethod
    def of(cls, rows: torch.Tensor, eos_ids: frozenset[int] = frozenset()) -> "StepLogits":
        if rows.device.type == "cpu":
            return cls(rows)
        ids = greedy_pair(rows, eos_tensor(eos_ids, rows.device)).tolist()
        return cls(rows, ids, eos_ids)

    def row(self, i: int) -> "torch.Tensor | DeviceLogits":
        if self.ids is None:
            return self.rows[i]
        return DeviceLogits(self.rows[i], self.ids[i][0], self.ids[i][1], self.eos_ids)
