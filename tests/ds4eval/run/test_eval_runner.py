"""Runner + engine backend against a scripted fake model: statuses, budgets, controls, traces."""

import threading
import time

import pytest

from ds4eval.cases import grade
from ds4eval.cases.case import parse_case
from ds4eval.config import EvalConfig
from ds4eval.run import trace as tr
from ds4eval.run.backends.engine_backend import EngineBackend
from ds4eval.run.runner import (CaseFinished, GenerationResult, Runner, Status, StatusChanged, TextDelta,
                                outcome)
from engine.threads import EngineThread
from ds4eval.run.summary import PlainListener, build_summary, render_report

from engine_fakes import FAKE_ENGINE, FakeModel


def case(i, answer="4", kind="integer", max_tokens=None, question=None):
    return parse_case({"source": "toy", "id": f"c{i}", "domain": "math", "question": question or f"What is {i}?",
                       "answer": answer, "answer_kind": kind, "max_tokens": max_tokens})


class Recorder:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def on_event(self, e):
        with self.lock:
            self.events.append(e)

    def statuses(self, index):
        return [e.status for e in self.events if isinstance(e, StatusChanged) and e.index == index]


def make(script=None, cases=None, cfg=None, **model_kw):
    model = FakeModel(script, **model_kw)
    rec = Recorder()
    runner = Runner(cfg or EvalConfig(), cases or [case(1), case(2, "5")], EngineBackend(model, FAKE_ENGINE), [rec])
    return runner, rec, model


def test_statuses_grades_and_prefix_reuse(tmp_path):
    cfg = EvalConfig(trace=str(tmp_path / "t.trace"))
    runner, rec, model = make(cfg=cfg)
    states = runner.run()
    assert [s.status for s in states] == [Status.PASSED, Status.FAILED]
    assert rec.statuses(0) == [Status.PREFILL, Status.THINKING, Status.PASSED]
    assert "".join(e.text for e in rec.events if isinstance(e, TextDelta) and e.index == 0) == "Answer: 4"
    assert states[0].gen_tokens == len("Answer: 4") + 1  # the EOS is sampled too
    assert len(model.sessions) == 1  # one session reused: the system prompt prefix is not prefilled twice
    records = tr.read_trace(tmp_path / "t.trace").records
    assert [(r.index, r.status, r.picked, r.expected) for r in records] == [(1, "PASSED", "4", "4"),
                                                                           (2, "FAILED", "4", "5")]
    assert records[0].system_prompt and "What is 1?" in records[0].question_prompt
    assert records[0].question_prompt.endswith('"Answer: N", where N is the final integer.')


def test_budget_is_min_of_tokens_case_and_context():
    long_reply = lambda p: "x" * 500  # noqa: E731
    runner, _, model = make(long_reply, [case(1, max_tokens=40)], EvalConfig(tokens=100))
    assert runner.run()[0].gen_tokens == 40
    runner, _, _ = make(long_reply, [case(1)], EvalConfig(tokens=30))
    assert runner.run()[0].gen_tokens == 30
    # Context: the prompt plus the answer must fit; the fake raises if the KV cache would overflow.
    runner, _, model = make(long_reply, [case(1)], EvalConfig(tokens=16000), n_ctx=400)
    st = runner.run()[0]
    assert st.status is Status.FAILED and st.prompt_tokens + st.gen_tokens == 400
    runner, _, _ = make(long_reply, [case(1, question="q" * 500)], EvalConfig(), n_ctx=400)
    st = runner.run()[0]
    assert st.status is Status.SKIPPED and "no room" in st.error


def test_backend_exception_is_an_error_status_not_a_crash():
    def boom(prompt):
        raise RuntimeError("kaput")
    runner, _, _ = make(boom)
    states = runner.run()
    assert {s.status for s in states} == {Status.ERROR} and "kaput" in states[0].error


def test_thinking_closed_by_the_model_and_forced_close():
    natural = lambda p: "let me see</think>\nAnswer: 4"  # noqa: E731
    runner, rec, _ = make(natural, [case(1)], thinking=True)
    st = runner.run()[0]
    assert st.status is Status.PASSED and st.think_close == "natural" and st.output.startswith("<think>")
    assert any(e.thinking for e in rec.events if isinstance(e, TextDelta))
    # Thinks forever: at the soft reserve it is nudged, at the hard reserve the block is closed.
    endless = lambda p: "hmm " * 1000  # noqa: E731
    runner, _, _ = make(endless, [case(1, max_tokens=2000)], thinking=True)
    st = runner.run()[0]
    assert st.think_close == "hard" and "</think>" in st.output and "running out of time" in st.output
    assert st.status is Status.FAILED
    runner, _, _ = make(endless, [case(1, max_tokens=2000)], EvalConfig(think=False), thinking=True)
    st = runner.run()[0]
    assert st.think_close == "none" and not st.output.startswith("<think>")


def test_pause_resume_and_stop_at_token_boundary(tmp_path):
    cfg = EvalConfig(trace=str(tmp_path / "t.trace"))
    runner, rec, _ = make(lambda p: "y" * 2000, [case(1), case(2)], cfg, decode_delay=0.001)
    th = threading.Thread(target=runner.run)
    th.start()
    _wait(lambda: rec.statuses(0)[-1:] == [Status.THINKING])
    runner.pause()
    time.sleep(0.05)
    n = runner.snapshot()[0].gen_tokens
    time.sleep(0.1)
    assert runner.snapshot()[0].gen_tokens == n  # paused: no tokens
    runner.resume()
    _wait(lambda: runner.snapshot()[0].gen_tokens > n)
    runner.stop()
    th.join(5)
    states = runner.snapshot()
    assert states[0].status is Status.STOPPED and states[1].status is Status.PENDING
    assert [r.status for r in tr.read_trace(tmp_path / "t.trace").records] == ["STOPPED"]


def test_run_next_switches_the_running_case_and_rerun():
    runner, rec, _ = make(lambda p: "Answer: 4" if "What is 3?" in p else "z" * 300,
                          [case(1), case(2), case(3)], EvalConfig(tokens=300), decode_delay=0.002)
    runner.keep_alive = True
    th = threading.Thread(target=runner.run)
    th.start()
    _wait(lambda: rec.statuses(0)[-1:] == [Status.THINKING])
    assert runner.run_next(2)
    _wait(lambda: runner.snapshot()[2].status is Status.PASSED)
    assert Status.SWITCHED in rec.statuses(0)
    _wait(lambda: all(s.status.finished for s in runner.snapshot()))
    order = [e.state.index for e in rec.events if isinstance(e, CaseFinished)]
    assert order == [2, 0, 1]  # chosen case first, the switched one right after it
    assert runner.rerun(2)
    _wait(lambda: len([e for e in rec.events if isinstance(e, CaseFinished)]) == 4)
    runner.stop()
    th.join(5)
    assert runner.snapshot()[2].runs == 2


def test_report_and_summary(capsys):
    runner, _, _ = make()
    runner.listeners.append(PlainListener(2))
    states = runner.run()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2 eta 0:00] PASSED  toy/c1") and "FAILED" in out[1]
    summary = build_summary(states, runner.wall_s, {"suite": "toy", "backend": "engine", "model": "fake"})
    assert summary["totals"]["passed"] == 1 and summary["sources"][0]["cases"] == 2
    text = render_report(summary)
    assert "toy" in text and "TOTAL" in text and "passed 1/2" in text and "wall time" in text


def test_engine_latency_is_prefill_then_decode_steps(tmp_path):
    cfg = EvalConfig(trace=str(tmp_path / "t.trace"))
    runner, _, _ = make(lambda p: "Answer: 4", [case(1)], cfg, prefill_delay=0.05, decode_delay=0.01)
    [st] = runner.run()
    lat = st.latency
    assert lat.ttft_s >= 0.05 and lat.itl_per == "token"
    assert lat.itl_s >= 0.01 * 0.8 and lat.itl_max_s >= lat.itl_s
    assert lat.e2e_s >= lat.ttft_s + (st.gen_tokens - 1) * lat.itl_s * 0.99
    [r] = tr.read_trace(tmp_path / "t.trace").records
    assert r.concurrency == 1 and r.ttft_s == pytest.approx(lat.ttft_s, abs=1e-6)


def test_a_case_running_while_the_run_was_paused_has_no_latency(tmp_path):
    from ds4eval.run.latency import Latency

    measured = Latency(ttft_s=0.5, itl_s=0.01, itl_max_s=0.02, e2e_s=1.0, itl_per="token")

    class Pausing:
        name, model_name, n_ctx, max_concurrency = "pausing", "m", 100, 1
        runner = None

        def run_case(self, job, ctx):
            ctx.started(3)
            if job.index == 0:  # a pause while this case runs: its clock would measure the pause
                self.runner.pause()
                time.sleep(0.01)
                self.runner.resume()
            return GenerationResult(output="Answer: 4", latency=measured)

    backend = Pausing()
    runner = Runner(EvalConfig(trace=str(tmp_path / "t.trace")), [case(1), case(2)], backend)
    backend.runner = runner
    states = runner.run()
    assert states[0].latency == Latency() and states[1].latency == measured
    records = tr.read_trace(tmp_path / "t.trace").records
    assert records[0].ttft_s is None and records[1].ttft_s == 0.5


class ScriptedBackend:
    """Ends each run of a case with the next result of its script, as a backend would."""

    name, model_name, n_ctx, max_concurrency = "scripted", "scripted-model", 100, 1

    def __init__(self, script):
        self.script = {i: list(results) for i, results in script.items()}

    def run_case(self, job, ctx):
        ctx.started(3)
        return self.script[job.index].pop(0)


def test_each_outcome_is_graded_exactly_once(tmp_path, monkeypatch):
    graded = []
    real = grade.grade_output

    def counting(kind, answer, output, *rest):
        graded.append(output)
        return real(kind, answer, output, *rest)

    monkeypatch.setattr(grade, "grade_output", counting)
    script = {0: [GenerationResult(output="Answer: 1", interrupted="switch"), GenerationResult(output="Answer: 4")],
              1: [GenerationResult(output="Answer: 3")],
              2: [GenerationResult(output="Answer: 6", interrupted="stop")],
              3: [GenerationResult(output="Answer: 7", error="boom")],
              4: [GenerationResult(output="Answer: 8", skipped="no room")]}
    rec = Recorder()
    cfg = EvalConfig(trace=str(tmp_path / "t.trace"))
    states = Runner(cfg, [case(1), case(2, "5"), case(3), case(4), case(5)], ScriptedBackend(script), [rec]).run()
    assert [(s.status, s.picked) for s in states] == [
        (Status.PASSED, "4"), (Status.FAILED, "3"), (Status.STOPPED, "6"), (Status.ERROR, "7"),
        (Status.SKIPPED, "8")]
    # One grading per finished case, in the order they finished; the switched-out output never.
    finished = [e.state.index for e in rec.events if isinstance(e, CaseFinished)]
    assert finished == [1, 0, 2, 3, 4]
    assert graded == ["Answer: 3", "Answer: 4", "Answer: 6", "Answer: 7", "Answer: 8"]
    assert rec.statuses(0) == [Status.PREFILL, Status.THINKING, Status.SWITCHED,
                               Status.PREFILL, Status.THINKING, Status.PASSED]
    records = tr.read_trace(tmp_path / "t.trace").records
    assert [(r.index, r.status, r.picked, r.error) for r in records] == [
        (2, "FAILED", "3", ""), (1, "PASSED", "4", ""), (3, "STOPPED", "6", ""), (4, "ERROR", "7", "boom"),
        (5, "SKIPPED", "8", "no room")]


def test_outcome_precedence_switch_stop_skip_error_verdict():
    c = case(1)
    both = dict(output="Answer: 4", skipped="s", error="e")
    assert outcome(c, GenerationResult(interrupted="switch", **both)) == (Status.SWITCHED, None)
    assert outcome(c, GenerationResult(interrupted="stop", **both)) == (Status.STOPPED, "4")
    assert outcome(c, GenerationResult(**both)) == (Status.SKIPPED, "4")
    assert outcome(c, GenerationResult(output="Answer: 4", error="e")) == (Status.ERROR, "4")
    assert outcome(c, GenerationResult(output="Answer: 4")) == (Status.PASSED, "4")
    assert outcome(c, GenerationResult(output="no answer")) == (Status.FAILED, None)


def test_the_backend_closes_only_an_engine_thread_it_owns():
    lent = EngineThread("lent")
    try:
        EngineBackend(FakeModel(), FAKE_ENGINE, engine_thread=lent).close()
        assert not lent.closed
        EngineBackend(FakeModel(), FAKE_ENGINE, engine_thread=lent, own_thread=True).close()
        assert lent.closed
    finally:
        lent.close()


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail("condition not reached")
        time.sleep(0.005)
