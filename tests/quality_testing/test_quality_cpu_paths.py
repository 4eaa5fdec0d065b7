"""The engine's promises on every CPU kernel path this CPU runs (engine.kernels), on the
embedded model: the packed path within the mean-KL bound of float32, and prompt scoring (a
prefill) equal to the same tokens decoded one by one; and a broken kernel fails the KL gate."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import kernels
from quality_testing import gate_kld as gk

PATHS = kernels.host_paths()


@pytest.fixture(scope="module")
def float_base() -> gk.FloatBase:
    """One float32 base for every path's candidate, scored on the torch path (no compiled kernel,
    so a compiled attention kernel that is off is measured against torch's own ops, not against
    itself).  A base costs as much as a candidate: once per module, not once per path."""
    return gk.float_base(None, tokens=512, ctx=256, cpu_kernels="torch")


@pytest.mark.model
@pytest.mark.parametrize("path", PATHS)
def test_every_path_passes_the_kl_gate(float_base, path):
    result, failures = gk.judge_candidate(float_base, cpu_kernels=path)
    assert result.summary.positions == sum(float_base.lengths)
    assert failures == [], failures
    assert result.summary.kl_mean.value <= gk.BOUNDS.max_kl_mean


@pytest.mark.model
@pytest.mark.parametrize("path", PATHS)
def test_prompt_scoring_equals_decoding_token_by_token(embedded_path, path):
    import engine

    if path == "amx":
        pytest.skip("the amx path's tile kernel (32 rows and more) sums in another order")
    m = engine.load_model(embedded_path, cpu_kernels=path)
    ids = m.prompt_ids(m.tokenize("The quick brown fox jumps over the lazy dog, and then it runs into the forest."))
    scored = m.new_session().extend_logits(ids)
    one = m.new_session()
    one.sync(ids[:1])
    decoded = [one.logits]
    for t in ids[1:]:
        one.eval(t)
        decoded.append(one.logits)
    assert torch.equal(scored, torch.stack(decoded))


@pytest.mark.model
def test_a_kernel_that_drops_its_last_input_group_fails_the_kl_gate(monkeypatch):
    """The gate can fail: an int4 kernel that ignores each row's last 32 inputs."""
    good = kernels.cpu_kernels()
    if good.int4 is None:
        pytest.skip("no compiled int4 kernel on this path")

    def dropping(x, packed, scales, *codes):
        x = x.clone()
        x[:, -32:] = 0
        return good.int4(x, packed, scales, *codes)

    broken = dataclasses.replace(good, int4=dropping, int4_tiles=None, repack_int4=good.repack_int4)
    monkeypatch.setattr(kernels, "cpu_kernels", lambda name=None: broken)
    _, failures = gk.run_gate(None, tokens=256, ctx=256)
    assert any(f.startswith("mean KL") for f in failures), failures
