"""ds4-server command line: flags map onto ServerConfig, one-line errors, startup banner."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from server.cli import KV_FLAGS, banner, config_from_flags, main
from server.config import ServerConfig
from server.kvstore import KVStoreConfig
from server.tools import ToolsConfig
from server_fake_engine import FakeModel


def _config_fields() -> set[str]:
    """Flag-level fields: the server's own plus those of the embedded tools record."""
    own = {f.name for f in dataclasses.fields(ServerConfig)} - {"tools", "kv"}
    # tool_memory_max_bytes is fixed (512 MiB) and has no flag.
    tools = {f.name for f in dataclasses.fields(ToolsConfig)} - {"tool_memory_max_bytes"}
    assert set(KV_FLAGS.values()) == {f.name for f in dataclasses.fields(KVStoreConfig)}
    return own | tools | set(KV_FLAGS)


def test_every_flag_is_one_config_field():
    flag_names = {p.name for p in main.params if p.name != "help"}
    assert flag_names == _config_fields()


def test_defaults_match_the_specification():
    c = ServerConfig()
    assert c.host == "127.0.0.1" and c.keepalive_sec == 5 and c.max_body_mb == 64 and c.cors == ()
    assert c.header_timeout_sec == 10 and c.body_timeout_sec == 60 and c.max_connections == 512
    assert c.api_key is None and not c.insecure_no_auth and c.allowed_hosts == () and not c.verbose_paths
    assert c.max_body_bytes == 64 * 1024 * 1024
    assert c.tools == ToolsConfig(tool_syntax=None, tool_memory_max_ids=100_000, disable_exact_tool_replay=False)
    defaults = {p.name: p.default for p in main.params if p.name != "help"}
    assert config_from_flags(**defaults) == c


def test_kv_batching_and_thread_flags_fill_their_fields():
    c = config_from_flags(kv_disk_dir="/tmp/kv", kv_cache_budget_mb=12, kv_min_free_mb=7, batched_session=3,
                          threads=1, kv_type="f16")
    assert c.kv == KVStoreConfig(directory="/tmp/kv", budget_mb=12, min_free_mb=7)
    assert c.batched_session == 3 and c.threads == 1
    assert c.kv_type == "f16"
    assert ServerConfig().kv == KVStoreConfig(directory=None, budget_mb=4096) and ServerConfig().batched_session == 1
    assert ServerConfig().threads is None and ServerConfig().kv_type is None
    for flags in ({"kv_cache_budget_mb": 0}, {"batched_session": 0}, {"threads": 0}):
        result = CliRunner().invoke(main, [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()])
        assert result.exit_code == 2 and "must be at least 1" in result.output
    result = CliRunner().invoke(main, ["--kv-min-free-mb=-1"])
    assert result.exit_code == 2 and "kv_min_free_mb must be at least 0" in result.output


def test_tool_flags_fill_the_tools_record():
    c = config_from_flags(tool_syntax="glm", tool_memory_max_ids=7, disable_exact_tool_replay=True)
    assert c.tools == ToolsConfig(tool_syntax="glm", tool_memory_max_ids=7, disable_exact_tool_replay=True)
    assert not c.tools.new_memory().enabled


def test_help_lists_the_flags():
    out = CliRunner().invoke(main, ["--help"]).output
    for flag in ("--model", "--ctx", "--host", "--port", "--cors", "--chdir", "--device",
                 "--keepalive-sec", "--max-body-mb", "--log-level", "--tool-syntax", "--tool-memory-max-ids",
                 "--disable-exact-tool-replay", "--api-key", "DS4_API_KEY", "--insecure-no-auth", "--allowed-host",
                 "--max-connections", "--header-timeout-sec", "--body-timeout-sec", "--verbose-paths",
                 "--stream-interval-ms"):
        assert flag in out


@pytest.mark.parametrize("args,fragment", [
    (["--keepalive-sec", "0"], "keepalive_sec must be positive"),
    (["--stream-interval-ms", "-1"], "stream_interval_ms must be in 0..1000"),
    (["--max-body-mb", "-1"], "max_body_mb must be positive"),
    (["--port", "70000"], "port must be in"),
    (["--ctx", "2"], "ctx must be at least"),
    (["--log-level", "loud"], "loud"),
    (["--port", "abc"], "abc"),
    (["--tool-syntax", "xml"], "xml"),
    (["--kv-type", "f8"], "f8"),
    (["--tool-memory-max-ids", "-1"], "--tool-memory-max-ids must be >= 0"),
])
def test_bad_flags_are_one_line_usage_errors(args, fragment):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_missing_chdir_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["--chdir", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "--chdir" in result.output and "Traceback" not in result.output


def test_unloadable_model_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    result = CliRunner().invoke(main, ["--chdir", str(tmp_path), "--model", "broken.gguf"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: cannot load model")
    assert len(result.output.strip().splitlines()) == 1


def test_banner_names_model_memory_and_address():
    text = banner(FakeModel(n_ctx=1024), ServerConfig(port=9123, cors=("http://localhost:3000",)))
    assert "fake-model" in text
    assert "context 1024 tokens" in text
    assert "memory 1.1 MiB" in text          # 1e6 weights + 1024 * 100 KV bytes
    assert "http://127.0.0.1:9123 (CORS: http://localhost:3000)" in text
    assert "access: no API key; Host must be one of 127.0.0.1, ::1, localhost" in text
    assert "http://127.0.0.1:8080" in banner(FakeModel(), ServerConfig(port=0), port=8080)
    assert "reachable from other machines" not in text
    assert "tool syntax hermes, exact tool replay on (up to 100000 ids)" in text
    assert "tool syntax dsml, exact tool replay off" in banner(
        FakeModel(), ServerConfig(tools=ToolsConfig(tool_syntax="dsml", disable_exact_tool_replay=True)))
    exposed = banner(FakeModel(), ServerConfig(host="0.0.0.0", api_key="k"))
    assert "reachable from other machines" in exposed and "access: API key required (except /health); any Host" in exposed
    assert "CPU threads auto" in text and "CPU threads 1" in banner(FakeModel(), ServerConfig(threads=1))


def test_the_warm_up_shows_in_the_banner_where_it_ran():
    from engine.warmup import Plan, WarmUp

    ran = WarmUp(0.5, Plan((1, 2, 257), (1, 2, 4)), graphs=10)
    text = banner(FakeModel(), ServerConfig(batched_session=4), warmed=ran)
    assert "ds4-server: warm-up: 10 CUDA graphs captured in 0.50 s (decoding steps of 1-4 rows" in text
    for nothing in (None, WarmUp(0.0, skipped="no captured steps on cpu")):
        assert "warm-up" not in banner(FakeModel(), ServerConfig(), warmed=nothing)
    assert ServerConfig().warmup and not config_from_flags(warmup=False).warmup


def test_the_model_is_warmed_up_for_the_batched_sessions_before_it_serves(monkeypatch, tmp_path):
    """The server warms its model up for --batched-session rows (none with --no-warmup) on the
    engine thread, after loading and before it listens."""
    import threading

    import engine

    model = FakeModel()
    calls = []
    monkeypatch.setattr(engine, "load_model", lambda *a, **kw: model)
    monkeypatch.setattr(model, "warm_up", lambda rows: (calls.append((rows, threading.current_thread().name)),
                                                        FakeModel.warm_up(model, rows))[1])
    import server.app

    def stop(*a, **kw):  # the app is built after the warm-up: stop there
        raise KeyboardInterrupt
    monkeypatch.setattr(server.app, "create_app", stop)
    for args, want in ((["--batched-session", "3"], [(3, "ds4-inference")]), (["--no-warmup"], [])):
        calls.clear()
        CliRunner().invoke(main, ["--port", "0", *args])
        assert calls == want


def test_a_warm_up_that_fails_is_a_one_line_error(monkeypatch):
    import engine

    model = FakeModel()
    monkeypatch.setattr(engine, "load_model", lambda *a, **kw: model)

    def out_of_memory(rows):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(model, "warm_up", out_of_memory)
    result = CliRunner().invoke(main, ["--port", "0"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == ("Error: cannot warm the model up (--no-warmup skips it): CUDA out of memory. "
                                     "Tried to allocate 2.00 GiB")


def test_threads_flag_sets_the_engine_threads_before_loading(monkeypatch):
    import threading

    import torch

    import engine

    seen = {}

    def load(*args, **kwargs):
        seen["threads"] = torch.get_num_threads()
        seen["thread"] = threading.current_thread().name
        raise engine.ModelLoadError("no model here")

    before = torch.get_num_threads()
    monkeypatch.setattr(engine, "load_model", load)
    try:
        want = 1 if before != 1 else 2
        result = CliRunner().invoke(main, ["--threads", str(want)])
        assert result.exit_code == 1 and "cannot load model: no model here" in result.output
        # The model is loaded on the engine thread, which runs with the requested threads.
        assert seen == {"threads": want, "thread": "ds4-inference"}
    finally:
        torch.set_num_threads(before)


def test_a_second_server_on_a_held_cache_directory_refuses_to_start_with_one_line(tmp_path):
    """Checked before the model loads (the model path here does not even exist)."""
    import os
    import subprocess
    import sys

    from server.kvstore import LOCK_NAME, KVStore, ModelIdentity
    from server_support import REPO_ROOT

    d = tmp_path / "kv"
    held = KVStore(d, ModelIdentity("m#0", "Q4_1", 256))  # the first server, for the lock's purpose
    try:
        done = subprocess.run([sys.executable, "-m", "server.cli", "--model", str(tmp_path / "absent.gguf"),
                               "--port", "0", "--kv-disk-dir", str(d)], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    finally:
        held.close()
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"Error: --kv-disk-dir {d}: another process (pid {os.getpid()})")
    assert LOCK_NAME in lines[0]
