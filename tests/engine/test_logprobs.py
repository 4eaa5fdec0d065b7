"""engine.logprobs: the normaliser against float64, the row scores against a float64 log-softmax."""
from __future__ import annotations

import pytest
import torch

from engine.logprobs import BLOCK, log_normalizer, score_rows


@pytest.mark.parametrize("width", [7, BLOCK, 3 * BLOCK + 5, 49152])
def test_the_normaliser_is_within_5e_7_of_float64(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g) * 6
    x[0, 3 % width] = 80.0  # one dominant entry
    got = log_normalizer(x)
    assert got.dtype == torch.float64 and got.shape == (9,)
    assert float((got - torch.logsumexp(x.double(), -1)).abs().max()) < 5e-7


def test_row_scores_match_a_float64_log_softmax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 1000, generator=g) * 4
    targets = [3, 999, 0, 512, 7]
    s = score_rows(x, targets, 4)
    ref = torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(s.target_logprobs, ref[torch.arange(5), torch.tensor(targets)], atol=5e-7, rtol=0)
    want_vals, want_ids = torch.topk(ref, 4, -1)
    assert torch.equal(s.top_ids, want_ids)
    torch.testing.assert_close(s.top_logprobs, want_vals, atol=5e-7, rtol=0)
    assert score_rows(x, targets, 5000).top_ids.shape == (5, 1000)  # k capped at the vocabulary
