"""A helper for the gpu-marked tests of launch options that must not change any bit: a step
replayed from a CUDA graph and the same step run eagerly, on inputs changed after the capture.
It runs nothing without a CUDA device and asserts nothing itself."""
from __future__ import annotations

from typing import Callable

import torch


def replayed_and_eager(step: Callable[[], tuple[torch.Tensor, ...]],
                       changed: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors `step` returns, (1) replayed from a CUDA graph captured before `changed`, an
    input it reads, had 1 added in place, and (2) computed eagerly after that; `changed` is
    restored.  The step runs once before the capture, so its kernels are compiled outside it."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    changed.add_(1.0)  # the graph must read its inputs as they are at replay
    graph.replay()
    torch.cuda.synchronize()
    replayed = [y.clone() for y in captured]
    eager = list(step())
    changed.sub_(1.0)
    return replayed, eager
