"""The scheduler's public methods for callers between steps: `session(i)`, `abandon_all()`,
`prefilling` and `step(prefill=False)`."""
from __future__ import annotations

import engine
from engine.batch import BatchScheduler, GenRequest


def test_session_is_the_slot_session_and_abandon_all_detaches_everything(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=256))
    m.prefill_chunk = 8
    sched = BatchScheduler(m, 2, check_memory=False)
    assert sched.n_slots == 2 and sched.session(0) is not sched.session(1)
    running = [GenRequest(ids=list(range(1, 30)), max_tokens=50, slot=i) for i in range(2)]
    queued = GenRequest(ids=[5, 6, 7], max_tokens=5, slot=0)
    for r in running + [queued]:
        sched.submit(r)
    sched.step()
    assert sched.session(0).tokens  # a prefill chunk went into slot 0
    abandoned = sched.abandon_all()
    assert abandoned == running + [queued]
    assert all(r.finish is None for r in abandoned)
    assert not sched.busy and all(sched.session(i).tokens == [] for i in range(2))
    # The slots serve again.
    again = GenRequest(ids=[1, 2, 3], max_tokens=3)
    sched.submit(again)
    sched.run()
    assert again.finish == "length" and len(again.output) == 3


def test_a_step_without_prefill_decodes_and_leaves_the_chunk_waiting(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1", n_ctx=256))
    m.prefill_chunk = 8
    sched = BatchScheduler(m, 2, check_memory=False)
    decoding = GenRequest(ids=[1, 2, 3], max_tokens=20, slot=0)
    sched.submit(decoding)
    sched.step()  # its one chunk, then its first token
    assert not sched.prefilling and len(decoding.output) == 1
    long = GenRequest(ids=list(range(1, 30)), max_tokens=2, slot=1)
    sched.submit(long)
    assert sched.prefilling
    sched.step(prefill=False)
    assert sched.session(1).tokens == [] and len(decoding.output) == 2  # decoding went on, no chunk ran
    sched.step()
    assert len(sched.session(1).tokens) == 8 and sched.prefilling
