"""engine_bench logic without weights: config, token sequence, scheduling, summary, table, CSV."""
from __future__ import annotations

import csv
import dataclasses
import os

import pytest

from ds4bench import engine_bench as eb
from ds4bench.csvfile import write_csv


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Advances a shared fake clock by fixed costs, so every timing is known exactly."""

    def __init__(self, engine: str, clock: FakeClock, log: list, load_s: float, prefill_tok_s: float,
                 decode_tok_s: float, vocab: eb.Vocab | None = None, batch_step_s: float = 0.01):
        self.engine, self.clock, self.log = engine, clock, log
        self.device, self.weights, self.threads, self.ctx, self.model_name = "cpu", "packed", 2, 4096, "m.gguf"
        self.load_s, self.prefill_tok_s, self.decode_tok_s = load_s, prefill_tok_s, decode_tok_s
        self.batch_step_s = batch_step_s  # one step of all rows, whatever their number
        self.batches: list[list[list[int]]] = []
        self._vocab = vocab or eb.Vocab(tuple(range(10, 50)), 1, True, frozenset({2}))
        self.loaded = False
        self.fed: list[list[int]] = []
        self.banned: list[frozenset] = []

    def kernels(self):
        return f"{self.engine}'s fake kernels"

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

    def prefill_batch(self, rows):
        assert self.loaded
        self.batches.append([list(r) for r in rows])
        self.clock.now += sum(map(len, rows)) / self.prefill_tok_s
        self.log.append((self.engine, "prefill_batch", len(rows)))

    def decode_batch(self, n, banned):
        self.banned.append(banned)
        self.clock.now += n * self.batch_step_s
        self.log.append((self.engine, "decode_batch", n))
        return [[11] * n for _ in self.batches[-1]]

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
    ({"batch_sizes": (4, 0)}, "--batch-sizes"),
    ({"batch_sizes": (4,), "batch_context": 0}, "--batch-context"),
    ({"batch_sizes": (4,), "compare": "llama.cpp"}, "llama-cpp-python decodes one sequence"),
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


def test_batches_are_off_by_default_and_need_their_context():
    assert eb.EngineBenchConfig().batch_sizes == ()
    cfg = eb.EngineBenchConfig(batch_sizes=(1, 64), batch_context=4000, decode_tokens=100)
    assert cfg.required_ctx == 4100 and cfg.sequence_length == 2048  # batch rows are drawn apart
    with pytest.raises(eb.BenchConfigError, match="--ctx 4099 is too small"):
        eb.EngineBenchConfig(batch_sizes=(2,), batch_context=4000, decode_tokens=100, ctx=4099).validate()
    eb.EngineBenchConfig(batch_sizes=(2,), compare="transformers").validate()


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


def test_batches_follow_the_steps_of_each_repetition_and_time_only_their_steps():
    clock, log = FakeClock(), []
    vocab = eb.Vocab(tuple(range(10, 50)), 1, True, frozenset({2}))
    ours = FakeRunner("ds4", clock, log, load_s=2.0, prefill_tok_s=512, decode_tok_s=100, vocab=vocab,
                      batch_step_s=0.02)
    other = FakeRunner("transformers", clock, log, load_s=0.5, prefill_tok_s=256, decode_tok_s=200,
                       batch_step_s=0.05)
    cfg = small_cfg(batch_sizes=(1, 4), batch_context=12, warmup=1)
    ms = eb.run_engine_bench(cfg, [ours, other], clock=clock)
    one_rep = [x[1:] for x in log if x[0] == "ds4"][:11]
    assert one_rep == [("load",), ("vocab",), ("prefill", 8), ("decode", 10), ("prefill", 64), ("prefill", 256),
                       ("decode", 10), ("prefill_batch", 1), ("decode_batch", 10), ("prefill_batch", 4),
                       ("decode_batch", 10)]
    assert ours.log[-1] == ("transformers", "close")
    # Row i: the benchmark sequence of seed + 1 + i, batch_context ids; both engines fed the same.
    rows = ours.batches[1]
    assert rows == [eb.benchmark_ids(vocab, 12, cfg.seed + 1 + i) for i in range(4)]
    assert rows[0] == ours.batches[0][0] and len({tuple(r) for r in rows}) == 4 and rows[0][0] == 1
    assert ours.batches == other.batches and len(ours.batches) == 2 * (cfg.warmup + cfg.repeats)
    assert all(b == frozenset({2}) for b in ours.banned + other.banned)

    assert len(ms) == 2 * 2 * (1 + 2 + 2 + 2)
    batch = {(m.engine, m.batch, m.repeat): m for m in ms if m.metric == "decode_batch"}
    assert len(batch) == 2 * 2 * 2
    x4 = batch[("ds4", 4, 1)]
    assert (x4.n_prompt, x4.n_decode) == (12, 10)
    assert x4.seconds == pytest.approx(10 * 0.02)  # the rows' prefill is not timed
    assert x4.tokens_per_s == pytest.approx(4 * 10 / (10 * 0.02))
    assert batch[("transformers", 1, 0)].tokens_per_s == pytest.approx(10 / (10 * 0.05))
    assert {m.batch for m in ms if m.metric != "decode_batch"} == {1}
    assert "decode 10 x4 after 12" in eb.describe_plan(cfg)
    assert eb.progress_line(x4).startswith("[1] ds4       decode x4 after 12")


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

def m(engine, metric, n_prompt, n_decode, repeat, seconds, batch=1):
    return eb.Measurement(engine, "m.gguf", "cpu", "packed", 2, 4096, metric, n_prompt, n_decode, repeat, seconds,
                          batch)


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


def test_batch_rows_in_summary_and_table_have_ratios_and_no_bar():
    out = sample_measurements()
    for r, (a, b) in enumerate([(1.0, 2.0), (1.0, 2.0), (3.0, 2.0)]):  # seconds for 64 rows x 128 tokens
        out += [m("ds4", "decode_batch", 128, 128, r, a, 64), m("transformers", "decode_batch", 128, 128, r, b, 64)]
        out += [m("ds4", "decode_batch", 128, 128, r, 1.0, 8), m("transformers", "decode_batch", 128, 128, r, 4.0, 8)]
    hf = [x for x in out if x.engine != "llama.cpp"]
    rows = eb.summarize(hf, "transformers")
    assert [r.label for r in rows] == ["load", "prefill 512", "decode 128 after 16",
                                       "decode x8 after 128", "decode x64 after 128"]
    x64 = rows[-1]
    assert x64.batch == 64 and x64.unit == "tok/s"
    assert x64.stats["ds4"].median == pytest.approx(64 * 128 / 1.0) and x64.ratio == pytest.approx(2.0)
    assert rows[-2].ratio == pytest.approx(4.0)
    text = eb.render_table(rows, ["ds4", "transformers"], "transformers")
    line = next(line for line in text.splitlines() if line.startswith("decode x64 after 128"))
    assert "8192.0 [2730.7, 8192.0]" in line and "2.00x" in line
    # Even where the other engine has batch rows with ratios, only the one-sequence steps have a bar.
    as_llama = [dataclasses.replace(x, engine="llama.cpp") if x.engine == "transformers" else x for x in out]
    checks = eb.check_bar(eb.summarize(as_llama, "llama.cpp"), "llama.cpp")
    assert [c.what for c in checks] == ["ds4 load", "prefill 512", "decode 128 after 16"]


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
    ms = sample_measurements() + [m("ds4", "decode_batch", 128, 16, 0, 0.5, 64)]
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
    assert {r["batch"] for r in rows if r["metric"] != "decode_batch"} == {"1"}
    batched = rows[-1]
    assert (batched["metric"], batched["batch"], batched["n_prompt"], batched["n_decode"]) == ("decode_batch", "64",
                                                                                               "128", "16")
    assert float(batched["tokens_per_s"]) == pytest.approx(64 * 16 / 0.5)
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

    from ds4bench.runners import load_llama

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


def test_llama_cpp_offloads_only_to_a_cuda_device_its_build_supports():
    from types import SimpleNamespace

    from ds4bench.runners import llama_offloads

    gpu_build = SimpleNamespace(llama_supports_gpu_offload=lambda: True)
    cpu_build = SimpleNamespace(llama_supports_gpu_offload=lambda: False)
    assert llama_offloads(gpu_build, "cuda")
    assert not llama_offloads(cpu_build, "cuda")
    assert not llama_offloads(gpu_build, "cpu")


def test_cpu_kernel_paths_are_the_engines():
    from engine import kernels

    assert eb.CPU_KERNEL_PATHS == kernels.PATHS


def test_an_unknown_cpu_kernel_path_is_a_config_error():
    with pytest.raises(eb.BenchConfigError, match="--cpu-kernels must be one of"):
        eb.EngineBenchConfig(cpu_kernels="sse9").validate()
