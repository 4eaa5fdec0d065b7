"""ds4-eval --parallel: batched cases through engine.batch give the traces of a one-at-a-time run."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import engine
from ds4eval.cases import prompts
from ds4eval.cases.case import parse_case
from ds4eval.config import ConfigError, EvalConfig
from ds4eval.run import trace as tr
from ds4eval.run.backends.engine_backend import EngineBackend, injection_due
from ds4eval.run.runner import Runner, Status
from engine.synthetic import RandomModelSpec, write_random_gguf

from engine_fakes import FAKE_ENGINE, FakeModel, peaked_logits


def case(i, answer="4", question=None):
    return parse_case({"source": "toy", "id": f"c{i}", "domain": "math", "question": question or f"What is {i}+{i}?",
                       "answer": answer, "answer_kind": "integer"})


def run_trace(cfg: EvalConfig, cases, backend, tmp_path, name: str) -> tuple[list, list]:
    path = tmp_path / f"{name}.trace"
    cfg = dataclasses.replace(cfg, trace=str(path))
    states = Runner(cfg, cases, backend).run()
    if hasattr(backend, "close"):
        backend.close()
    records = tr.parse_trace(path.read_text()).records
    return states, sorted(records, key=lambda r: r.index)


def same_traces(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.index, x.id, x.status, x.picked, x.gen_tokens, x.prompt_tokens, x.think_close) == \
               (y.index, y.id, y.status, y.picked, y.gen_tokens, y.prompt_tokens, y.think_close)
        assert x.model_output == y.model_output


# ---------------------------------------------------------------- the real scheduler on a tiny random model

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = write_random_gguf(tmp_path_factory.mktemp("par") / "tiny.gguf",
                             RandomModelSpec(n_ctx=1024, seed=11, n_layer=2))
    # One intra-op thread: a model this small only pays for thread hand-offs on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield engine.load_model(path)
    torch.set_num_threads(threads)


def test_parallel_4_gives_the_traces_of_parallel_1(tiny_model, tmp_path):
    cases = [case(i) for i in range(1, 6)]
    cfg = dict(tokens=20, think=False)
    _, one = run_trace(EvalConfig(parallel=1, **cfg), cases, EngineBackend(tiny_model, engine, parallel=1),
                       tmp_path, "p1")
    states, four = run_trace(EvalConfig(parallel=4, **cfg), cases, EngineBackend(tiny_model, engine, parallel=4),
                             tmp_path, "p4")
    assert all(s.status in (Status.PASSED, Status.FAILED) for s in states)
    assert sum(r.gen_tokens for r in four) > 5  # something was generated
    same_traces(one, four)
    # ... and both equal a serial greedy run in which the case starts from a fresh session.
    for r in four[:2]:
        c = next(c for c in cases if c.id == r.id)
        _, (alone,) = run_trace(EvalConfig(**cfg), [c], EngineBackend(tiny_model, engine), tmp_path, f"s{c.id}")
        assert (alone.model_output, alone.gen_tokens) == (r.model_output, r.gen_tokens)


def test_parallel_cases_really_overlap(tiny_model, tmp_path):
    seen = []

    class Spy:
        def on_event(self, e):
            if type(e).__name__ == "StatusChanged":
                seen.append((e.index, e.status))

    backend = EngineBackend(tiny_model, engine, parallel=3)
    Runner(EvalConfig(parallel=3, tokens=16, think=False), [case(i) for i in range(1, 4)], backend, [Spy()]).run()
    backend.close()
    # All three were running before the first one finished.
    first_done = next(k for k, (_, st) in enumerate(seen) if st.finished)
    assert len({i for i, st in seen[:first_done] if st is Status.PREFILL}) == 3


def test_capacity_error_names_the_figures(tiny_model):
    with pytest.raises(engine.batch.CapacityError, match="MiB"):
        EngineBackend(tiny_model, engine, parallel=10 ** 7)


# ---------------------------------------------------------------- thinking: a history-driven fake

HEADER = [259] + list(b"assistant\n")


class HistorySession:
    """Its next token is a pure function of the tokens it holds, so any route to a history agrees."""

    def __init__(self, model):
        self.model, self.tokens = model, []

    @property
    def n_past(self):
        return len(self.tokens)

    def sync(self, ids, progress=None, cancel=None):
        keep = 0
        while keep < min(len(ids), len(self.tokens)) and ids[keep] == self.tokens[keep]:
            keep += 1
        self.tokens = list(ids)
        return keep

    def truncate(self, n):
        del self.tokens[n:]

    def eval(self, tok):
        self.tokens.append(tok)

    @property
    def logits(self):
        return peaked_logits(self.model.n_vocab, self.model.next_token(self.tokens), self.model.eos_id)

    @property
    def raw_logits(self):  # a CPU session's frontier row is its host tensor
        return self.logits

    def sample(self, params=None):
        return self.model.next_token(self.tokens)


class HistoryModel(FakeModel):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.replies: dict[tuple, list[int]] = {}

    def new_session(self):
        return HistorySession(self)

    def next_token(self, hist):
        p = max(i for i, t in enumerate(hist) if t == HEADER[0] and hist[i:i + len(HEADER)] == HEADER) + len(HEADER)
        if hist[p:p + 2] == [257, 10]:  # the "<think>\n" the template opened
            p += 2
        prompt = tuple(hist[:p])
        if prompt not in self.replies:
            self.replies[prompt] = self.reply_ids(self.detokenize(hist[:p]))
        reply = self.replies[prompt]
        k = len(hist) - p
        return reply[k] if k < len(reply) else self.eos_id


def think_script(prompt: str) -> str:
    if "What is 1+" in prompt:  # thinks past every reserve: soft nudge, then hard close
        return "x" * 2000
    if "What is 2+" in prompt:  # closes on its own after the nudge
        return "y" * 460 + "z" * 64 + "</think>\nAnswer: 4"
    if "What is 3+" in prompt:  # closes on its own early
        return "short</think>\nAnswer: 6"
    return "no thought at all</think>Answer: 8"


def test_batched_cases_record_their_latency_and_the_concurrency(tmp_path):
    model = FakeModel(lambda p: "Answer: 4", decode_delay=0.002)
    states, records = run_trace(EvalConfig(parallel=2, tokens=50), [case(i) for i in range(1, 4)],
                                EngineBackend(model, FAKE_ENGINE, parallel=2), tmp_path, "lat")
    for st in states:
        lat = st.latency
        assert lat.ttft_s > 0 and lat.e2e_s >= lat.ttft_s and lat.itl_per == "token"
        assert lat.itl_s > 0 and lat.itl_max_s >= lat.itl_s
    assert all(r.concurrency == 2 and r.ttft_s and r.itl_s for r in records)


def test_think_close_decisions_match_the_serial_path(tmp_path):
    cases = [case(i, answer=str(2 * i)) for i in range(1, 5)]
    cfg = dict(tokens=600)
    model = HistoryModel(think_script, thinking=True)
    _, serial = run_trace(EvalConfig(**cfg), cases, EngineBackend(model, FAKE_ENGINE), tmp_path, "serial")
    _, batched = run_trace(EvalConfig(parallel=3, **cfg), cases, EngineBackend(model, FAKE_ENGINE, parallel=3),
                           tmp_path, "batched")
    assert [r.think_close for r in serial] == ["hard", "soft", "natural", "natural"]
    assert prompts.THINK_SOFT_NUDGE in serial[0].model_output and prompts.THINK_HARD_CLOSE in serial[0].model_output
    assert serial[2].status == "PASSED"
    same_traces(serial, batched)


def test_a_batched_case_hands_its_tokens_over_in_batches():
    from ds4eval.run.backends import engine_backend as eb

    plan = eb._Plan(ids=[1, 2], text="", think=True, budget=10, soft_reserve=0, hard_reserve=0, n_soft=0, n_hard=0)
    case = eb._BatchedCase(plan, ctx=None, model=FakeModel(lambda p: ""), text=eb.ThinkText(True))

    def handed():
        out = []
        while not case.events.empty():
            out.append(case.events.get_nowait())
        return out

    case.take("<think>", True, now=100.0)  # the first token goes at once
    assert handed() == [("tokens", 1, [("<think>", True)])]
    case.take("a", True, now=100.005)
    case.take("", None, now=100.01)  # a token without text (an end of sequence) counts
    case.take("b", True, now=100.015)
    case.take("c", False, now=100.018)
    assert handed() == []  # held: within HANDOVER_S of the last hand-over
    case.take("d", False, now=100.0 + 1.25 * eb.HANDOVER_S)
    assert handed() == [("tokens", 5, [("ab", True), ("cd", False)])]  # text in runs of one flag
    case.take("e", False, now=100.03)
    case.hand_over(now=100.031)  # a request's end: the rest goes now
    assert handed() == [("tokens", 1, [("e", False)])]
    case.hand_over(now=100.032)
    assert handed() == []  # nothing held, nothing sent


def test_batched_cases_report_every_token_and_all_their_text(tmp_path):
    # Steps far shorter than the hand-over interval: tokens reach the worker in batches, and
    # the progress and text the listeners see still add up to each case's output.
    class Seen:
        def __init__(self):
            self.tokens, self.text, self.events = {}, {}, 0

        def on_event(self, ev):
            from ds4eval.run.runner import Progress, TextDelta

            if isinstance(ev, Progress):
                self.tokens[ev.index] = ev.gen_tokens
                self.events += 1
            elif isinstance(ev, TextDelta):
                self.text[ev.index] = self.text.get(ev.index, "") + ev.text

    seen = Seen()
    model = FakeModel(lambda p: "Answer: " + "4" * 200)
    cases = [case(i) for i in range(1, 4)]
    backend = EngineBackend(model, FAKE_ENGINE, parallel=3)
    states = Runner(EvalConfig(parallel=3, tokens=300), cases, backend, [seen]).run()
    backend.close()
    for st in states:
        assert seen.tokens[st.index] == st.gen_tokens > 200
        assert seen.text[st.index] == st.output
    assert seen.events < sum(st.gen_tokens for st in states)


def test_injection_due_rules():
    # budget 600: soft reserve 150, hard 75; nudge 74 tokens, hard close 15
    assert injection_due(True, "none", 151, 150, 75, 74, 15) is None
    assert injection_due(True, "none", 150, 150, 75, 74, 15) == "soft"
    assert injection_due(True, "none", 149, 150, 75, 74, 15) is None  # the nudge no longer fits
    assert injection_due(True, "soft", 75, 150, 75, 74, 15) == "hard"
    assert injection_due(True, "soft", 15, 150, 75, 74, 15) is None  # nor the close
    assert injection_due(False, "none", 10, 150, 75, 74, 15) is None


def test_parallel_flag_is_validated():
    with pytest.raises(ConfigError, match="--parallel must be at least 1"):
        EvalConfig(parallel=0).validate()
    with pytest.raises(ConfigError, match="engine backend"):
        EvalConfig(parallel=2, backend="openai", urls=("http://x",)).validate()
    with pytest.raises(ConfigError, match="--threads must be at least 1"):
        EvalConfig(threads=0).validate()


def test_threads_setting_reaches_the_engine_thread(tmp_path):
    path = write_random_gguf(tmp_path / "t.gguf", RandomModelSpec(n_ctx=256, seed=6, n_layer=1))
    backend = EngineBackend.load(EvalConfig(model=str(path), threads=1))
    try:
        assert backend.engine_thread.threads_now == 1
        assert backend.engine_thread.call(torch.get_num_threads) == 1
    finally:
        backend.close()


@pytest.mark.parametrize("parallel,warmup,rows", [(None, True, [1]), (6, True, [6]), (6, False, [])])
def test_the_loaded_model_is_warmed_up_for_the_run_s_batches(monkeypatch, parallel, warmup, rows):
    """`EngineBackend.load` warms the model up for --parallel rows (one row serially) unless
    --no-warmup, and notes the warm-up's line where it ran."""
    from engine.warmup import Plan, WarmUp

    model = FakeModel()
    monkeypatch.setattr(engine, "load_model", lambda *a, **kw: model)
    ran = WarmUp(0.25, Plan((1, 2), (1, 2, 4, 8)), graphs=6)
    monkeypatch.setattr(model, "warm_up", lambda n: (model.warmed_up.append(n), ran)[1])
    notes = []
    backend = EngineBackend.load(EvalConfig(parallel=parallel, warmup=warmup), note=notes.append)
    backend.close()
    assert model.warmed_up == rows
    assert notes == ([ran.describe()] if warmup else [])
    quiet = FakeModel()  # its warm-up runs nothing (as on CPU): no line
    monkeypatch.setattr(engine, "load_model", lambda *a, **kw: quiet)
    notes.clear()
    EngineBackend.load(EvalConfig(parallel=parallel), note=notes.append).close()
    assert notes == [] and quiet.warmed_up == [parallel or 1]


# ---------------------------------------------------------------- the embedded model

@pytest.mark.model
def test_sanity_suite_parallel_matches_parallel_1(tmp_path):
    from ds4eval.cases import case as cs
    from ds4eval.cases.suites import load_suite

    model = engine.load_model(ctx=2048)
    sanity = load_suite("sanity", cs.resolve_data_dir(None))[:4]
    cfg = dict(tokens=48)
    _, one = run_trace(EvalConfig(parallel=1, **cfg), sanity, EngineBackend(model, engine, parallel=1), tmp_path, "1")
    _, four = run_trace(EvalConfig(parallel=4, **cfg), sanity, EngineBackend(model, engine, parallel=4), tmp_path, "4")
    same_traces(one, four)


@pytest.mark.parametrize("parallel", [None, 2])
def test_the_backend_loads_and_runs_every_forward_pass_on_one_engine_thread(tmp_path, monkeypatch, parallel):
    import threading

    from engine import threads

    path = write_random_gguf(tmp_path / "t.gguf", RandomModelSpec(n_ctx=512, seed=5, n_layer=2))
    seen = []
    real_load, real_forward = engine.load_model, threads.before_forward

    def load(*args, **kwargs):
        seen.append(("load", threading.current_thread().name))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine, "load_model", load)
    monkeypatch.setattr(threads, "before_forward",
                        lambda: (seen.append(("forward", threading.current_thread().name)), real_forward()))
    cfg = EvalConfig(model=str(path), parallel=parallel, tokens=6, think=False)
    backend = EngineBackend.load(cfg)
    states = Runner(cfg, [case(i) for i in range(1, 4)], backend).run()
    backend.close()
    assert all(s.status.finished for s in states)
    assert seen[0] == ("load", "ds4eval-engine")
    assert {kind for kind, _ in seen} == {"load", "forward"}
    assert {name for _, name in seen} == {"ds4eval-engine"}
    assert backend.engine_thread.closed
