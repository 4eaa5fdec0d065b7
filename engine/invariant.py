"""Batch-invariant mode: every token through one row's decoding step, whatever the batch.

`BatchInvariant(net)` wraps any architecture's network (engine.protocols.Network) so that each
token of each sequence is computed by the same code with the same shapes: the network's
one-row decoding step at that token's position (`decode_frontier`: on CUDA the captured graph of
one row, elsewhere the eager one-row step). Concretely:
- a decoding step of N rows runs N one-row steps, one after another;
- a prefill of T tokens runs T one-row steps (and scoring keeps each step's logits);
- a greedy session's run-ahead already launches one-row steps, and is passed through, as is a
  batch scheduler's where its batch is one row (of more rows it launches nothing).
What a token's logits are then depends on its sequence alone: not on the other requests in the
batch, on how the prompt was split into prefill chunks, on whether a prefix came from the cache
(its keys and values were computed by the same steps), on `n`, streaming or `max_tokens`.

The price is the batch's parallelism: prefill runs at decoding speed, and N rows decode at the
speed of one row N times (docs/measurements.md, "Determinism", states it). The CPU paths need
none of this below 32 rows (their kernels are row-independent) and the mode is for stacks that
are not: the CUDA path, whose GEMM splits and attention kernels follow the row count, and the
`amx` CPU path's prefill tiles. It changes no weights and no kernel; `load_model(...,
batch_invariant=True)` installs it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.device_sampling import DeviceLogits, StepLogits
from engine.errors import Cancelled


def _row_tensor(logits: "torch.Tensor | DeviceLogits") -> torch.Tensor:
    """One step's logits row as a tensor of its own (a graph's output buffer is reused by the
    next replay, so the row is copied before the next step)."""
    return (logits.row if isinstance(logits, DeviceLogits) else logits).clone()


class BatchInvariant:
    """A Network whose every token goes through the wrapped network's one-row step."""

    def __init__(self, net: Any):
        self.net = net

    def __getattr__(self, name: str) -> Any:
        # Everything but the forward passes (cfg, sizes, caches, banners) is the network's own.
        return getattr(self.net, name)

    @property
    def attention_path(self) -> str:
        return f"{self.net.attention_path}, batch-invariant (one row a step)"

    def decode_frontier(self, token: int, cache: Any, eos_ids: frozenset[int] = frozenset(),
                        cancel: Callable[[], bool] | None = None) -> Any:
        return self.net.decode_frontier(token, cache, eos_ids, cancel)

    def decode_ahead(self, token: int | None, cache: Any, eos_ids: frozenset[int], ahead: int,
                     after: Any = None, column: int = 0) -> Any:
        return self.net.decode_ahead(token, cache, eos_ids, ahead, after, column)

    def decode_launch(self, tokens: list[int] | None, caches: list[Any], eos_ids: frozenset[int],
                      ahead: int = 0, after: Any = None, column: int = 0) -> Any:
        """One cache's step is the one-row step and passes through; several rows are never
        launched as one step (None: the caller decodes them row by row)."""
        if len(caches) != 1:
            return None
        return self.net.decode_launch(tokens, caches, eos_ids, ahead, after, column)

    def decode(self, tokens: list[int], caches: list[Any], eos_ids: frozenset[int] = frozenset()) -> StepLogits:
        rows = [_row_tensor(self.net.decode_frontier(int(t), c, eos_ids)) for t, c in zip(tokens, caches)]
        return StepLogits.of(torch.stack(rows), eos_ids)

    def decode_started(self, tokens: list[int], caches: list[Any],
                       eos_ids: frozenset[int] = frozenset()) -> Callable[[], StepLogits]:
        step = self.decode(tokens, caches, eos_ids)  # row by row, finished before it returns
        return lambda: step

    def forward_rows(self, tokens: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        rows = [_row_tensor(self.net.decode_frontier(int(t), c)) for t, c in zip(tokens.tolist(), caches)]
        return torch.stack(rows).float()

    def forward(self, tokens: torch.Tensor, start: int, cache: Any, logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        cache.n = min(cache.n, start)  # positions from `start` on are written anew, as forward does
        kept = []
        last = None
        for token in tokens.tolist():
            if cancel is not None and cancel():
                raise Cancelled(f"cancelled after {cache.n - start} of {tokens.shape[0]} tokens")
            step = self.net.decode_frontier(int(token), cache)
            if logits == "all":
                kept.append(_row_tensor(step))
            elif logits == "last":
                last = step
        if logits == "all":
            return torch.stack(kept).float()
        if logits == "last":
            return _row_tensor(last).float()
        return None
