"""Loading: clear errors for bad files and unsupported models; memory accounting."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch

import engine
from engine import ModelLoadError
from engine.synthetic import RandomModelSpec, write_random_gguf


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        engine.load_model(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x89PNG not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        engine.load_model(bad)


def test_truncated_gguf(tiny_gguf, tmp_path):
    data = open(tiny_gguf("llama", "Q4_1"), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        engine.load_model(cut)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_random_gguf(tmp_path / "m.gguf", RandomModelSpec(arch="llama"))
    data = bytearray(open(path, "rb").read())
    i = data.index(b"general.architecture")
    j = data.index(b"llama", i)
    data[j: j + 5] = b"mamba"  # same length: the file stays well formed
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        engine.load_model(odd)


def test_bad_context_and_device(tiny_gguf):
    path = tiny_gguf("llama", "Q4_1")
    with pytest.raises(ModelLoadError, match="context"):
        engine.load_model(path, ctx=100_000)
    with pytest.raises(ModelLoadError):
        engine.load_model(path, device="nonsense")
    with pytest.raises(ModelLoadError, match="weights"):
        engine.load_model(path, weights="int3")


def test_memory_accounting(tiny_gguf):
    m = engine.load_model(tiny_gguf("qwen3", "Q4_0"), ctx=128)
    cfg = m.config
    assert m.kv_dtype == torch.float16  # the CPU default with packed weights
    assert m.kv_bytes_per_token == 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 2
    assert m.new_session().cache.kv.dtype == torch.float16 and m.new_sessions(2)[1].cache.kv.dtype == torch.float16
    full = engine.load_model(tiny_gguf("qwen3", "Q4_0"), ctx=128, kv_type="f32")
    assert full.kv_dtype == torch.float32 and full.kv_bytes_per_token == 2 * m.kv_bytes_per_token
    exact = engine.load_model(tiny_gguf("qwen3", "Q4_0"), ctx=128, weights="float32")
    assert exact.kv_dtype == torch.float32  # the reference path keeps a float32 cache
    with pytest.raises(ModelLoadError, match="unknown KV cache type 'f8'"):
        engine.load_model(tiny_gguf("qwen3", "Q4_0"), ctx=128, kv_type="f8")
    assert m.weight_bytes > 0
    one, four = m.memory_bytes(1, 128), m.memory_bytes(4, 128)
    assert four - one == 3 * 128 * m.kv_bytes_per_token
    s = m.new_session()
    s.sync(list(range(100)))
    assert s.cache.nbytes <= 128 * m.kv_bytes_per_token


def test_an_int4_head_over_a_vocabulary_of_any_size_loads(tmp_path):
    path = write_random_gguf(tmp_path / "untied.gguf", RandomModelSpec(seed=3, tied_output=False, qtype="Q4_1"))
    packed, exact = engine.load_model(path), engine.load_model(path, weights="float32")
    assert packed.n_vocab % 16 != 0
    ids = torch.tensor([5, 77, 130, 2, 250, 9])
    got = packed.net.forward(ids, 0, packed.new_session().cache, logits="all")
    want = exact.net.forward(ids, 0, exact.new_session().cache, logits="all")
    assert got.shape == want.shape == (6, packed.n_vocab)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_prompt_ids_adds_bos_once_when_the_model_wants_it(tiny_gguf):
    m = engine.load_model(tiny_gguf("llama", "Q4_1"), ctx=128)
    bos = m.bos_id
    assert bos is not None
    m.tokenizer.add_bos = True
    ids = [5, 6]
    out = m.prompt_ids(ids)
    assert out == [bos, 5, 6] and ids == [5, 6]  # a new list; the argument is left alone
    assert m.prompt_ids([bos, 5]) == [bos, 5] and m.prompt_ids([]) == [bos]
    m.tokenizer.add_bos = False
    same = m.prompt_ids(ids)
    assert same == ids and same is not ids
    with pytest.raises(TypeError, match="tokenize the text first"):
        m.prompt_ids("hi")


def test_default_model_path_prefers_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4_MODEL", str(tmp_path / "x.gguf"))
    assert engine.default_model_path() == str(tmp_path / "x.gguf")


def run_cli(*args, env=None):
    """`ds4` in its own process: `python -m engine` and its exit status as the shell sees them."""
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def invoke_cli(*args, env=None):
    """`ds4` in-process (click's runner, stdout and stderr apart): for the tests of what it
    prints, which need no process of their own."""
    from click.testing import CliRunner

    from engine import cli

    return CliRunner().invoke(cli.main, list(args), env=env)


def escaped(r) -> BaseException | None:
    """The exception that escaped an in-process run (a traceback in a real one), None when it exited."""
    return None if r.exception is None or isinstance(r.exception, SystemExit) else r.exception


def test_cli_generates_and_reports_speed(tiny_gguf):
    r = run_cli("-m", tiny_gguf("llama", "Q4_1"), "-p", "hi the", "-n", "5", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "prefill:" in r.stderr and "tokens/s" in r.stderr


def test_cli_bad_model_is_one_line_error(tmp_path):
    r = invoke_cli("-m", str(tmp_path / "missing.gguf"), "-p", "hi")
    assert r.exit_code == 1 and escaped(r) is None
    assert r.stderr.strip().splitlines() == [f"ds4: error: model file not found: {tmp_path / 'missing.gguf'}"]
    assert "Traceback" not in r.stderr


def test_cli_version_says_which_cpu_kernels_run_and_why():
    from engine import kernels

    r = invoke_cli("--version", env={kernels.ENV_VAR: "portable"})
    assert r.exit_code == 0 and escaped(r) is None, r.stderr
    assert "CPU kernels: portable (DS4_CPU_KERNELS=portable)" in r.stdout
    assert "other paths this CPU runs" in r.stdout and "torch" in r.stdout.splitlines()[-1]


def test_cli_version_fails_for_a_path_this_cpu_cannot_run():
    r = invoke_cli("--version", env={"DS4_CPU_KERNELS": "no-such-path"})
    assert r.exit_code == 1 and escaped(r) is None and "unknown CPU kernel path 'no-such-path'" in r.stdout
    assert "Traceback" not in r.stderr


def test_cli_bad_kernel_override_is_one_line_error(tiny_gguf):
    r = invoke_cli("-m", tiny_gguf("llama", "Q4_1"), "-p", "hi", env={"DS4_CPU_KERNELS": "no-such-path"})
    assert r.exit_code == 1 and escaped(r) is None
    assert r.stderr.strip().splitlines() == ["ds4: error: unknown CPU kernel path 'no-such-path' "
                                             "(expected one of amx, avx512, avx2, portable, torch)"]


# ---------------------------------------------------------------- a model too large for the machine


def test_a_model_that_cannot_fit_is_refused_before_any_work(monkeypatch):
    """Where even the least its weights can take exceeds the memory available, the load stops
    with one line saying so, before any matrix is laid out (not killed for memory partway)."""
    import engine.model as em

    def no_network(*args, **kwargs):
        raise AssertionError("a network was built")

    monkeypatch.setattr(em, "memory_for_weights", lambda device: 5 << 20)
    monkeypatch.setattr(em, "network_class", lambda arch: no_network)
    with pytest.raises(ModelLoadError, match=r"weights need at least 63 MiB on cpu once laid out for the kernels, "
                                             r"and 5 MiB is available"):
        engine.load_model()


def moe_file(tmp_path, family: str) -> str:
    from deepseek2_models import DeepSeek2Spec, write_random_deepseek2
    from moe_models import MoeSpec, write_random_moe

    path = tmp_path / f"{family}.gguf"
    if family == "deepseek2":
        return write_random_deepseek2(path, DeepSeek2Spec(qtype="Q4_0"))
    return write_random_moe(path, MoeSpec(arch=family, qtype="Q4_0"))


@pytest.mark.parametrize("family", ["embedded", "llama-Q6_K", "qwen3moe", "qwen2moe", "deepseek2"])
def test_the_bound_is_below_what_every_path_takes(family, tmp_path, tiny_gguf):
    """min_resident_bytes is a lower bound: loaded on every CPU path this host runs, each model's
    weights take at least that much (so the check above never refuses a model that fits)."""
    from engine.gguf_file import read_gguf
    from engine.kernels import host_paths
    from engine.weights import min_resident_bytes

    if family == "embedded":
        path = None
    elif family == "llama-Q6_K":
        path = tiny_gguf("llama", "Q6_K")
    else:
        path = moe_file(tmp_path, family)
    for cpu in host_paths():
        try:
            m = engine.load_model(path, ctx=64, cpu_kernels=cpu)
        except ModelLoadError as e:
            if "CPU kernels" in str(e):  # a path this machine cannot build
                continue
            raise
        least = min_resident_bytes(read_gguf(m.path).tensors.values(), m.config.n_layer)
        assert 0 < least <= m.weight_bytes, (cpu, least, m.weight_bytes)
