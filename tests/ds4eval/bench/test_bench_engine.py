"""engine_bench logic without weights: config, token sequence, scheduling, summary, table, CSV."""
from __future__ import annotations

import csv
import os

import pytest

from ds4eval.bench import engine_bench as eb
from ds4eval.bench.csvfile import write_csv


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Advances a shared fake clock by fixed costs, so every timing is known exactly."""

    def __init__(self, engine: str, clock: FakeClock, log: list, load_s: float, prefill_tok_s: float,
                 decode_tok_s: float, vocab: eb.Vocab | None = None):
        self.engine, self.clock, self.log = engine, clock, log
        self.device, self.weights, self.threads, self.ctx, self.model_name = "cpu", "packed", 2, 4096, "m.gguf"
        self.load_s, self.prefill_tok_s, self.decode_tok_s = load_s, prefill_tok_s, decode_tok_s
        self._vocab = vocab or eb.Vocab(tuple(range(10, 50)), 1, True, frozenset({2}))
        self.loaded = False
        self.fed: list[list[int]] = []
        self.banned: list[frozenset] = []

    def load(self):
        assert not self.loaded, "load twice without close"
        self.loaded = True
        self.clock.now += self.load_s
        self.log.append((self.engine, "load"))

    def vocab(self):
        self.log.append((self.engine, "vocab"))
        return self._vocab

    def prefill(self, ids):
        assert self.loaded
        self.fed.append(list(ids))
        self.clock.now += len(ids) / self.prefill_tok_s
        self.log.append((self.engine, "prefill", len(ids)))

    def decode(self, n, banned):
        self.banned.append(banned)
        self.clock.now += n / self.decode_tok_s
        self.log.append((self.engine, "decode", n))
        return [11] * n

    def close(self):
        self.loaded = False
        self.log.append((self.engine, "close"))


# ---------------------------------------------------------------- config

def test_defaults_match_the_specification():
    cfg = eb.EngineBenchConfig()
    assert cfg.prefill_lengths == (512, 2048)
    assert cfg.context_lengths == (16, 2048)
    assert cfg.n_decode == 128
    assert cfg.repeats == 3
    assert cfg.required_ctx == 2048 + 128 == cfg.load_ctx


def test_quick_shortens_defaults_but_explicit_values_win():
    q = eb.EngineBenchConfig(quick=True)
    assert max(q.prefill_lengths) <= 128 and q.n_decode <= 16
    mixed = eb.EngineBenchConfig(quick=True, prompt_lengths=(7,), decode_tokens=3)
    assert mixed.prefill_lengths == (7,) and mixed.n_decode == 3 and mixed.context_lengths == eb.QUICK_DECODE_CONTEXTS


@pytest.mark.parametrize("kwargs, words", [
    ({"repeats": 0}, "--repeats"),
    ({"ctx": 100}, "--ctx 100 is too small"),
    ({"prompt_lengths": (0, 5)}, "positive"),
    ({"decode_tokens": 0}, "--decode-tokens"),
    ({"compare": "vllm"}, "--compare"),
    ({"device": "tpu"}, "--device"),
    ({"weights": "int8"}, "--weights"),
    ({"threads": 0}, "--threads"),
    ({"prompt_lengths": (), "decode_contexts": ()}, "nothing to measure"),
])
def test_validation_errors_are_one_line(kwargs, words):
    with pytest.raises(eb.BenchConfigError) as e:
        eb.EngineBenchConfig(**kwargs).validate()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_ctx_must_cover_context_plus_decoded_tokens():
    cfg = eb.EngineBenchConfig(prompt_lengths=(100,), decode_contexts=(90,), decode_tokens=20, ctx=109)
    with pytest.raises(eb.BenchConfigError):
        cfg.validate()
    eb.EngineBenchConfig(prompt_lengths=(100,), decode_contexts=(90,), decode_tokens=20, ctx=110).validate()


def test_parse_lengths():
    assert eb.parse_lengths("512, 2048") == (512, 2048)
    assert eb.parse_lengths("") == ()
    with pytest.raises(eb.BenchConfigError):
        eb.parse_lengths("512,lots")


# ---------------------------------------------------------------- token sequence

def test_ordinary_ids_keep_normal_tokens_only():
    types = [3, 1, 1, 4, 1, 6, 1]
    assert eb.ordinary_ids(types, 7, exclude=[2, None]) == (1, 4, 6)
    assert eb.ordinary_ids(None, 5, exclude=[0]) == (1, 2, 3, 4)
    with pytest.raises(eb.BenchConfigError):
        eb.ordinary_ids([3, 3], 2, exclude=[])


def test_benchmark_ids_are_deterministic_prefix_closed_and_ordinary():
    vocab = eb.Vocab(tuple(range(100, 200)), bos_id=1, add_bos=True, eos_ids=frozenset({2}))
    a = eb.benchmark_ids(vocab, 300, seed=0)
    assert a == eb.benchmark_ids(vocab, 300, seed=0)
    assert a != eb.benchmark_ids(vocab, 300, seed=1)
    assert len(a) == 300 and a[0] == 1 and all(100 <= t < 200 for t in a[1:])
    assert eb.benchmark_ids(vocab, 50, seed=0) == a[:50]
    no_bos = eb.Vocab(vocab.ordinary, 1, False, vocab.eos_ids)
    assert 1 not in eb.benchmark_ids(no_bos, 300, seed=0)


# ---------------------------------------------------------------- scheduling and timing

def small_cfg(**kw) -> eb.EngineBenchConfig:
    base = dict(prompt_lengths=(64, 256), decode_contexts=(8, 256), decode_tokens=10, repeats=2, warmup=0)
    return eb.EngineBenchConfig(**{**base, **kw})


def test_plan_reuses_a_prefill_as_decode_context():
    steps = eb.plan_steps(small_cfg())
    assert steps == [eb.Step(8, False, True), eb.Step(64, True, False), eb.Step(256, True, True)]


def test_engines_interleave_per_repetition_and_timings_are_exact():
    clock, log = FakeClock(), []
    ours = FakeRunner("ds4", clock, log, load_s=2.0, prefill_tok_s=512, decode_tok_s=100)
    other = FakeRunner("llama.cpp", clock, log, load_s=0.5, prefill_tok_s=256, decode_tok_s=200)
    seen = []
    ms = eb.run_engine_bench(small_cfg(), [ours, other], clock=clock, report=seen.append)
    assert seen == ms
    loads = [e for e, *rest in log if rest == ["load"]]
    assert loads == ["ds4", "llama.cpp", "ds4", "llama.cpp"]
    assert [x for x in log if x[1] == "vocab"] == [("ds4", "vocab")]  # asked once, of the first engine
    assert not ours.loaded and not other.loaded  # closed after every repetition
    # Both engines were fed the very same ids.
    assert ours.fed == other.fed and [len(f) for f in ours.fed[:3]] == [8, 64, 256]
    assert ours.fed[2][:64] == ours.fed[1]
    assert all(b == frozenset({2}) for b in ours.banned + other.banned)

    by = {(m.engine, m.metric, m.n_prompt, m.repeat): m for m in ms}
    assert by[("ds4", "load", 0, 1)].seconds == pytest.approx(2.0)
    assert by[("llama.cpp", "prefill", 256, 0)].tokens_per_s == pytest.approx(256)
    assert by[("ds4", "prefill", 64, 0)].tokens_per_s == pytest.approx(512)
    d = by[("ds4", "decode", 256, 1)]
    assert d.n_decode == 10 and d.tokens_per_s == pytest.approx(100)  # the context's prefill is excluded
    assert by[("llama.cpp", "decode", 8, 0)].tokens_per_s == pytest.approx(200)
    assert ("ds4", "prefill", 8, 0) not in by  # context-only step is not a prefill measurement
    assert len(ms) == 2 * 2 * (1 + 2 + 2)


def test_warmup_repetitions_run_first_and_are_not_recorded():
    clock, log = FakeClock(), []
    ours = FakeRunner("ds4", clock, log, load_s=2.0, prefill_tok_s=512, decode_tok_s=100)
    other = FakeRunner("llama.cpp", clock, log, load_s=0.5, prefill_tok_s=256, decode_tok_s=200)
    seen = []
    ms = eb.run_engine_bench(small_cfg(warmup=1), [ours, other], clock=clock, report=seen.append)
    loads = [e for e, *rest in log if rest == ["load"]]
    assert loads == ["ds4", "llama.cpp"] * 3  # one untimed round, then the two timed ones
    assert seen == ms and len(ms) == 2 * 2 * (1 + 2 + 2)
    assert sorted({m.repeat for m in ms}) == [0, 1]
    assert ours.fed[:3] == ours.fed[3:6]  # the warm-up fed the same ids as the timed rounds
    with pytest.raises(eb.BenchConfigError):
        small_cfg(warmup=-1).validate()


def test_runner_is_closed_when_a_step_fails():
    class Broken(FakeRunner):
        def prefill(self, ids):
            raise RuntimeError("boom")

    clock, log = FakeClock(), []
    r = Broken("ds4", clock, log, 1, 1, 1)
    with pytest.raises(RuntimeError):
        eb.run_engine_bench(small_cfg(), [r], clock=clock)
    assert log[-1] == ("ds4", "close")


# ---------------------------------------------------------------- summary, table, bar

def m(engine, metric, n_prompt, n_decode, repeat, seconds):
    return eb.Measurement(engine, "m.gguf", "cpu", "packed", 2, 4096, metric, n_prompt, n_decode, repeat, seconds)


def sample_measurements():
    out = []
    for r, (a, b) in enumerate([(1.0, 0.5), (3.0, 0.4), (2.0, 0.6)]):
        out += [m("ds4", "load", 0, 0, r, a), m("llama.cpp", "load", 0, 0, r, b)]
    for r, (a, b) in enumerate([(1.0, 2.0), (1.0, 1.0), (4.0, 1.0)]):  # seconds for 512 tokens
        out += [m("ds4", "prefill", 512, 0, r, a), m("llama.cpp", "prefill", 512, 0, r, b)]
    for r, (a, b) in enumerate([(2.0, 1.0), (2.0, 1.0), (2.0, 1.0)]):  # seconds for 128 tokens
        out += [m("ds4", "decode", 16, 128, r, a), m("llama.cpp", "decode", 16, 128, r, b)]
    return out


def test_summary_medians_extremes_and_ratios():
    rows = eb.summarize(sample_measurements(), "llama.cpp")
    assert [r.label for r in rows] == ["load", "prefill 512", "decode 128 after 16"]
    load, prefill, decode = rows
    assert load.stats["ds4"] == eb.Stat(2.0, 1.0, 3.0, 3) and load.unit == "s"
    assert load.ratio == pytest.approx(2.0 / 0.5)
    assert prefill.stats["ds4"].median == pytest.approx(512.0) and prefill.stats["ds4"].lo == pytest.approx(128.0)
    assert prefill.stats["llama.cpp"].median == pytest.approx(512.0)
    assert prefill.ratio == pytest.approx(1.0)
    assert decode.ratio == pytest.approx(0.5)


def test_summary_without_comparison_has_no_ratio():
    only = [x for x in sample_measurements() if x.engine == "ds4"]
    assert all(r.ratio is None for r in eb.summarize(only, None))


def test_table_shows_medians_ranges_and_ratios():
    rows = eb.summarize(sample_measurements(), "llama.cpp")
    text = eb.render_table(rows, ["ds4", "llama.cpp"], "llama.cpp")
    lines = text.splitlines()
    assert "ds4/llama.cpp" in lines[0]
    decode_line = next(line for line in lines if line.startswith("decode 128 after 16"))
    assert "64.0" in decode_line and "128.0" in decode_line and "0.50x" in decode_line
    assert "2.000 [1.000, 3.000]" in next(line for line in lines if line.startswith("load"))


def test_bar_checks():
    rows = eb.summarize(sample_measurements(), "llama.cpp")
    checks = {c.what: c for c in eb.check_bar(rows, "llama.cpp")}
    assert checks["ds4 load"].ok  # 2.0 s < 3 s
    assert checks["prefill 512"].ok  # 1.0x >= 1.0x
    assert not checks["decode 128 after 16"].ok  # 0.5x < 0.7x
    assert checks["decode 128 after 16"].line().startswith("FAIL")
    assert [c.what for c in eb.check_bar(rows, None)] == ["ds4 load"]


def test_the_load_bar_is_for_the_embedded_model_and_transformers_gets_no_bar():
    rows = eb.summarize(sample_measurements(), "llama.cpp")
    assert "ds4 load" not in {c.what for c in eb.check_bar(rows, "llama.cpp", embedded=False)}
    against_hf = [eb.SummaryRow(r.metric, r.n_prompt, r.n_decode, r.unit,
                                {("transformers" if k == "llama.cpp" else k): v for k, v in r.stats.items()}, r.ratio)
                  for r in rows]
    assert [c.what for c in eb.check_bar(against_hf, "transformers")] == ["ds4 load"]
    assert eb.check_bar(against_hf, "transformers", embedded=False) == []


# ---------------------------------------------------------------- CSV

def test_csv_rows_have_the_documented_columns(tmp_path):
    ms = sample_measurements()
    path = tmp_path / "out.csv"
    write_csv(path, eb.CSV_COLUMNS, eb.csv_rows(ms))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == eb.CSV_COLUMNS
    for col in eb.CSV_COLUMNS:
        assert f"  {col} " in eb.__doc__, f"column {col} is not documented"
    assert len(rows) == len(ms)
    load = rows[0]
    assert load["metric"] == "load" and load["tokens_per_s"] == ""
    dec = next(r for r in rows if r["metric"] == "decode")
    assert float(dec["tokens_per_s"]) == pytest.approx(int(dec["n_decode"]) / float(dec["seconds"]), rel=1e-3)
    assert os.listdir(tmp_path) == ["out.csv"]


def test_csv_write_is_atomic(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("previous\n")

    def rows():
        yield {"engine": "ds4"}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_csv(path, eb.CSV_COLUMNS, rows())
    assert path.read_text() == "previous\n"
    assert os.listdir(tmp_path) == ["out.csv"]
    with pytest.raises(ValueError):
        write_csv(path, ["a"], [{"a": 1, "unknown": 2}])
    assert path.read_text() == "previous\n"


def test_load_llama_without_extra_buffers_swaps_the_default_params_for_one_load():
    import types

    from ds4eval.bench.runners import load_llama

    class Params:
        use_extra_bufts = True

    binding = types.SimpleNamespace(llama_model_default_params=Params)
    seen = []

    class Llama:
        def __init__(self, **kwargs):
            seen.append((binding.llama_model_default_params().use_extra_bufts, kwargs))
            if kwargs.get("fail"):
                raise ValueError("cannot load")

    fake = types.SimpleNamespace(llama_cpp=binding, Llama=Llama)
    load_llama(fake, extra_buffers=False, model_path="m.gguf")
    assert seen[-1] == (False, {"model_path": "m.gguf"})
    assert binding.llama_model_default_params is Params  # restored
    with pytest.raises(ValueError):
        load_llama(fake, extra_buffers=False, fail=True)
    assert binding.llama_model_default_params is Params  # restored after a failed load too
    load_llama(fake, model_path="m.gguf")
    assert seen[-1][0] is True
