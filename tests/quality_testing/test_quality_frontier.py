"""The engine's logits against the stored transformers references, within the manifest's thresholds.

Runs every manifest case on the CPU packed path through one session (as
compare_frontier_logits does); the long-context prompts (1K, 3K and 7K tokens) are marked
slow, since `make test` runs compare_frontier_logits over every case. The thresholds are also shown to bite: a
perturbed engine vector fails them.
"""
from __future__ import annotations

import numpy as np
import pytest

from quality_testing import compare_frontier_logits as cf
from quality_testing import metrics as mx
from quality_testing import refset as rs

CASES = rs.parse_manifest(rs.MANIFEST.read_text(encoding="utf-8"))
PARAMS = [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.kind == "long" else []) for c in CASES]


@pytest.fixture(scope="module")
def session(packed_model):
    return packed_model.new_session()


@pytest.mark.model
@pytest.mark.parametrize("case", PARAMS)
def test_engine_matches_reference(packed_model, session, embedded_sha, case):
    ref = rs.read_reference(rs.REFERENCES / case.reference_file)
    rs.check_reference(case, ref, embedded_sha)
    res = cf.compare_case(packed_model, session, case, ref, rs.PROMPTS)
    print(cf.render_report([res], "packed"))
    assert res.tokens_match
    assert res.ok, res.failures


def test_judge_flags_each_threshold():
    case = CASES[0]
    good = mx.PositionStats(0.1, 0.01, 1e-4, 1.0, 1.0, 1.0, 0.001)
    assert cf.judge(case, [good, good], [3, 9], True) == []
    assert cf.judge(case, [good], [3], False) == ["prompt tokenizes differently from the reference"]
    worse = mx.PositionStats(case.max_abs_dlogit * 2, 1.0, case.max_kl * 2, 0.0, 0.2, 0.2, -case.max_dp_top * 2)
    msgs = cf.judge(case, [worse, worse], [3, 9], True)
    assert any("KL" in m for m in msgs) and any("max|Δlogit|" in m for m in msgs)
    assert any("Δp top" in m for m in msgs) and any("top-1" in m for m in msgs)


def test_thresholds_catch_a_perturbed_vector():
    """Noise of the size a broken kernel makes, on a real reference vector, crosses the thresholds."""
    case = next(c for c in CASES if c.kind == "chat")
    ref = rs.read_reference(rs.REFERENCES / case.reference_file).logits.astype(np.float32)
    noisy = ref + np.random.default_rng(0).normal(scale=1.0, size=ref.shape).astype(np.float32)
    assert cf.judge(case, mx.compare_rows(ref, noisy), list(range(len(ref))), True)


def test_server_top_texts_compare_with_the_reference():
    ref = np.array([5.0, 4.0, 3.0] + [0.0] * 30)
    texts = {i: f"t{i}" for i in range(33)}
    p0 = float(np.exp(mx.log_softmax(ref)[0]))
    top = {f"t{i}": float(mx.log_softmax(ref)[i]) for i in range(20)}
    st = cf.compare_top_texts(ref, top, texts.__getitem__)
    assert st.top1 == 1 and st.overlap5 == 1 and abs(st.dp_top) < 1e-12
    assert cf.judge_server(CASES[0], st) == []
    shifted = dict(top, t0=np.log(p0 / 2), t1=0.0)
    st = cf.compare_top_texts(ref, shifted, texts.__getitem__)
    assert st.top1 == 0 and st.dp_top == pytest.approx(-p0 / 2)
    assert cf.judge_server(CASES[0], st)
    missing = {k: v for k, v in top.items() if k != "t0"}
    assert cf.judge_server(CASES[0], cf.compare_top_texts(ref, missing, texts.__getitem__))[0].startswith("server")
