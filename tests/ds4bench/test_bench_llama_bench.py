"""`ds4-bench engine --compare llama.cpp --llama-bench PATH`: llama.cpp's own benchmark binaries as
the compared engine, with fake binaries that print reports in the recorded formats of llama-bench
(`-o json`) and llama-batched-bench (`--output-format jsonl`), so no llama.cpp build is needed."""
from __future__ import annotations

import csv
import json
import os
import stat
import sys

import pytest
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import engine_bench as eb
from ds4bench import llama_bench as lb
from engine.synthetic import PRESETS, write_moe_gguf

# One test record as llama-bench 0.3.36's vendored build prints it (the fields of its
# test::get_fields(), then the samples); the fakes below fill in the test's numbers.
RECORDED_TEST = {
    "build_commit": "b1a2c3d", "build_number": 7000, "cpu_info": "AMD EPYC", "gpu_info": "NVIDIA H200",
    "backends": "CUDA", "model_filename": "m.gguf", "model_type": "qwen3moe 30B.A3B Q4_K - Small",
    "model_size": 17298520064, "model_n_params": 30532122624, "n_batch": 2048, "n_ubatch": 512, "n_threads": 16,
    "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
    "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": True,
    "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none", "load_mode": "mmap",
    "lazy_mode": "off", "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
    "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
    "test_time": "2026-12-04T10:00:00Z", "avg_ns": 100000000, "stddev_ns": 0, "avg_ts": 5120.0, "stddev_ts": 0.0,
    "samples_ns": [100000000], "samples_ts": [5120.0],
}
RECORDED_BATCHED_LINE = ('{"n_kv_max": 17408, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, '
                         '"n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16, "pp": 128, "tg": 128, "pl": 64, '
                         '"n_kv": 16384, "t_pp": 0.512000, "speed_pp": 16000.000000, "t_tg": 2.048000, '
                         '"speed_tg": 4000.000000, "t": 2.560000, "speed": 6400.000000}')

# Prefill at 1000 tok/s; a decoded token takes 10 ms plus 1 us per context position; a batched
# step of N rows 20 ms whatever N.
FAKE_LLAMA_BENCH = r'''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + args) + "\n")
if os.environ.get("FAKE_FAIL"):
    print("llama_model_load: error loading model", file=sys.stderr)
    sys.exit(1)
def opt(flag, default):
    return args[args.index(flag) + 1] if flag in args else default
template = json.loads(os.environ["FAKE_TEMPLATE"])
print("ggml_cuda_init: found 1 CUDA devices:", file=sys.stderr)
tests = []
for p in [int(x) for x in opt("-p", "512").split(",")]:
    for n in [int(x) for x in opt("-n", "128").split(",")]:
        for d in [int(x) for x in opt("-d", "0").split(",")]:
            if p == 0 and n == 0:
                continue
            ns = int(1e9 * (p / 1000 if n == 0 else n * (0.010 + 1e-6 * d)))
            tests.append(dict(template, n_prompt=p, n_gen=n, n_depth=d, samples_ns=[ns], avg_ns=ns))
print(json.dumps(tests, indent=2))
'''
FAKE_BATCHED = r'''
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + args) + "\n")
def opt(flag):
    return args[args.index(flag) + 1]
line = json.loads(os.environ["FAKE_BATCHED_LINE"])
print("main: n_kv_max = ...")
pp, tg = int(opt("-npp")), int(opt("-ntg"))
for pl in [int(x) for x in opt("-npl").split(",")]:
    t_tg = tg * 0.020
    print(json.dumps(dict(line, pp=pp, tg=tg, pl=pl, t_tg=t_tg, speed_tg=pl * tg / t_tg)))
print("llama_perf_context_print: total time = ...")
'''


def script(path, body: str) -> str:
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n{body}")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture()
def fake_bin(tmp_path, monkeypatch):
    d = tmp_path / "build" / "bin"
    d.mkdir(parents=True)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_TEMPLATE", json.dumps(RECORDED_TEST))
    monkeypatch.setenv("FAKE_BATCHED_LINE", RECORDED_BATCHED_LINE)
    script(d / "llama-batched-bench", FAKE_BATCHED)
    return script(d / "llama-bench", FAKE_LLAMA_BENCH)


def calls(tmp_path) -> list[list[str]]:
    with open(tmp_path / "calls.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> str:
    import dataclasses

    spec = dataclasses.replace(PRESETS["qwen3moe-tiny"], n_layer=1, n_vocab=600)
    return write_moe_gguf(tmp_path_factory.mktemp("lb") / "moe.gguf", spec).path


def test_parse_llama_bench_report_with_log_lines_around_it():
    text = "ggml_cuda_init: found 1 CUDA devices:\n" + json.dumps(
        [RECORDED_TEST, dict(RECORDED_TEST, n_prompt=0, n_gen=128, n_depth=2048, samples_ns=[2_000_000_000])],
        indent=2) + "\n"
    assert lb.parse_llama_bench(text) == [lb.BenchRecord(512, 0, 0, 0.1), lb.BenchRecord(0, 128, 2048, 2.0)]
    old = {k: v for k, v in RECORDED_TEST.items() if k != "n_depth"}  # builds before -d
    assert lb.parse_llama_bench(json.dumps([old]))[0].n_depth == 0
    with pytest.raises(lb.LlamaBenchError, match="no JSON report"):
        lb.parse_llama_bench("error: unknown argument: -d\n")
    with pytest.raises(lb.LlamaBenchError, match="unexpected llama-bench test record"):
        lb.parse_llama_bench(json.dumps([{"n_prompt": 1}]))


def test_parse_batched_bench_skips_log_lines():
    text = "main: n_kv_max = 17408\n" + RECORDED_BATCHED_LINE + "\n\nllama_perf_context_print: ...\n"
    assert lb.parse_batched_bench(text) == [lb.BenchRecord(128, 128, 128, 2.048, 64)]
    with pytest.raises(lb.LlamaBenchError):
        lb.parse_batched_bench('{"pp": 1}')


def test_pick_names_what_is_missing():
    records = [lb.BenchRecord(512, 0, 0, 0.1)]
    assert lb.pick(records, "llama-bench", [(512, 0, 0, 1)]) == records
    with pytest.raises(lb.LlamaBenchError, match=r"\(0, 128, 16, 1\)"):
        lb.pick(records, "llama-bench", [(0, 128, 16, 1)])


def test_commands():
    flags = lb.common_flags(16, "cuda", "on")
    assert flags == ["-t", "16", "-ngl", "99", "-fa", "on"]
    assert lb.common_flags(2, "cpu", None) == ["-t", "2", "-ngl", "0"]
    assert lb.build_prefill_command("lb", "m.gguf", (512, 2048), flags) == \
        ["lb", "-m", "m.gguf", "-p", "512,2048", "-n", "0", "-r", "1", "-o", "json", *flags]
    assert lb.build_decode_command("lb", "m.gguf", 128, (16, 2048), flags) == \
        ["lb", "-m", "m.gguf", "-p", "0", "-n", "128", "-d", "16,2048", "-r", "1", "-o", "json", *flags]
    cmd = lb.build_batched_command("bb", "m.gguf", 128, 128, (1, 32, 64), flags)
    assert cmd[cmd.index("-c") + 1] == str(64 * 256) and cmd[cmd.index("-npl") + 1] == "1,32,64"
    assert cmd[cmd.index("--output-format") + 1] == "jsonl"


def test_engine_against_llama_bench_binaries(fake_bin, moe_file, tmp_path):
    out = tmp_path / "m.csv"
    r = CliRunner().invoke(cli.main, [
        "engine", "-m", moe_file, "--compare", "llama.cpp", "--llama-bench", fake_bin, "--llama-flash-attn", "on",
        "--prompt-lengths", "16", "--decode-contexts", "4,32", "--decode-tokens", "3", "--batch-sizes", "1,4",
        "--batch-context", "8", "--repeats", "2", "--warmup", "0", "--threads", "2", "--csv", str(out),
        "--bandwidth", "100"])
    assert r.exit_code == 0, r.output
    made = calls(tmp_path)
    assert [c[0] for c in made] == ["llama-bench", "llama-bench", "llama-batched-bench"] * 2  # one set a repetition
    assert all(c[c.index("-ngl") + 1] == "0" and c[c.index("-t") + 1] == "2" and c[c.index("-fa") + 1] == "on"
               for c in made)
    with open(out) as f:
        rows = [row for row in csv.DictReader(f) if row["engine"] == "llama.cpp"]
    got = {(row["metric"], int(row["n_prompt"]), int(row["batch"]), int(row["repeat"])): float(row["tokens_per_s"])
           for row in rows}
    assert len(got) == len(rows) == 2 * (1 + 2 + 2)  # no load figure: the binaries do not time loading
    assert got[("prefill", 16, 1, 0)] == pytest.approx(1000)
    assert got[("decode", 32, 1, 1)] == pytest.approx(1 / (0.010 + 32e-6))
    assert got[("decode_batch", 8, 4, 0)] == pytest.approx(4 / 0.020)
    assert "decode x4 after 8" in r.output and "ds4/llama.cpp" in r.output
    assert "weights read per decoding step of 4 rows" in r.output  # the routed experts' share, on stderr
    bound = [line for line in r.output.splitlines() if line.startswith("decode x4 after 8: weight-read bound")]
    assert len(bound) == 1 and "ds4 " in bound[0] and "llama.cpp " in bound[0]


def test_llama_bench_errors_are_one_line(fake_bin, moe_file, tmp_path, monkeypatch):
    base = ["engine", "-m", moe_file, "--prompt-lengths", "8", "--decode-contexts", "4", "--decode-tokens", "2",
            "--repeats", "1", "--warmup", "0"]

    def one_line(args, status):
        r = CliRunner().invoke(cli.main, base + args)
        assert r.exit_code == status, r.output
        lines = [x for x in r.output.strip().splitlines() if x.startswith("ds4-bench: error: ")]
        assert len(lines) == 1, r.output
        return lines[0]

    assert "--llama-bench needs --compare llama.cpp" in one_line(["--llama-bench", fake_bin], 2)
    assert "applies to --llama-bench only" in one_line(["--compare", "llama.cpp", "--llama-flash-attn", "on"], 2)
    plain = tmp_path / "plain"
    plain.write_text("")
    assert "not an executable file" in one_line(["--compare", "llama.cpp", "--llama-bench", str(plain)], 2)
    os.unlink(os.path.join(os.path.dirname(fake_bin), "llama-batched-bench"))
    line = one_line(["--compare", "llama.cpp", "--llama-bench", fake_bin, "--batch-sizes", "2"], 2)
    assert "llama-batched-bench" in line
    monkeypatch.setenv("FAKE_FAIL", "1")
    line = one_line(["--compare", "llama.cpp", "--llama-bench", fake_bin], 1)
    assert "exited with status 1" in line and "error loading model" in line


def test_config_accepts_batches_with_llama_bench_only():
    eb.EngineBenchConfig(batch_sizes=(1, 64), compare="llama.cpp", llama_bench="/x/llama-bench").validate()
    with pytest.raises(eb.BenchConfigError, match="llama-cpp-python decodes one sequence"):
        eb.EngineBenchConfig(batch_sizes=(1, 64), compare="llama.cpp").validate()
    with pytest.raises(eb.BenchConfigError, match="--llama-flash-attn must be one of"):
        eb.EngineBenchConfig(compare="llama.cpp", llama_bench="/x", llama_flash_attn="yes").validate()
