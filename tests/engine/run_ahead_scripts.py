"""Run-ahead test helper, shared by the CPU tests (test_session.py) and the GPU tests
(test_cuda_graphs.py): one script of session calls, run with and without steps ahead."""
from __future__ import annotations

import torch


def run_script(m, monkeypatch, ahead: int, ops) -> list:
    """Run `ops(session, record)` with engine.session.RUN_AHEAD = ahead; each record(*extra)
    keeps the session's tokens, cache length, logits and `extra`; the saved payload ends it."""
    import engine.session as es

    monkeypatch.setattr(es, "RUN_AHEAD", ahead)
    seen: list = []
    s = m.new_session()

    def record(*extra) -> None:
        seen.append((list(s.tokens), s.cache.n, s.logits.clone(), *extra))

    ops(s, record)
    seen.append(s.save_payload())
    return seen


def assert_same(a: list, b: list) -> None:
    """Two scripts' records equal: logits bitwise (the same steps at the same positions) and
    the valid keys and values too."""
    assert len(a) == len(b)
    for x, y in zip(a[:-1], b[:-1]):
        assert x[:2] == y[:2] and x[3:] == y[3:]
        assert torch.equal(x[2], y[2])
    assert a[-1] == b[-1]


def dropping_ops(prompt: list[int]):
    """A script in which every kind of change drops the steps launched ahead: another token,
    truncate, sync, a restore, reset."""
    from engine import SamplingParams

    greedy = SamplingParams(argmax_ignoring_eos=True)

    def ops(s, record) -> None:
        s.sync(prompt)
        s.eval((s.sample(greedy) + 1) % 200)  # not the token launched ahead
        record()
        for _ in range(3):
            s.eval(s.sample(greedy))
            record()
        s.sample(greedy)
        s.truncate(len(prompt) + 1)  # no frontier logits now: evaluate a given token
        s.eval(prompt[3])
        record()
        s.eval(s.sample(greedy))
        record()
        s.sample(greedy)
        saved = s.save_payload()
        s.sync(prompt[:5] + [7, 8])
        record()
        s.sample(greedy)
        s.load_payload(saved)
        record()
        s.eval(s.sample(greedy))
        record()
        s.sample(greedy)
        s.reset()
        s.sync(prompt[:9])
        s.eval(s.sample(greedy))
        record()
    return ops
