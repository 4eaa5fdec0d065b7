"""ds4-server command line: flags map onto ServerConfig, one-line errors, startup banner."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from server.cli import banner, main
from server.config import ServerConfig
from server_fake_engine import FakeModel


def test_every_flag_is_one_config_field():
    flag_names = {p.name for p in main.params if p.name != "help"}
    assert flag_names == {f.name for f in dataclasses.fields(ServerConfig)}


def test_defaults_match_the_specification():
    c = ServerConfig()
    assert c.host == "127.0.0.1" and c.keepalive_sec == 5 and c.max_body_mb == 64 and not c.cors
    assert c.max_body_bytes == 64 * 1024 * 1024
    defaults = {p.name: p.default for p in main.params if p.name != "help"}
    assert ServerConfig(**defaults) == c


def test_help_lists_the_flags():
    out = CliRunner().invoke(main, ["--help"]).output
    for flag in ("--model", "--ctx", "--host", "--port", "--cors", "--chdir", "--device",
                 "--keepalive-sec", "--max-body-mb", "--log-level"):
        assert flag in out


@pytest.mark.parametrize("args,fragment", [
    (["--keepalive-sec", "0"], "keepalive_sec must be positive"),
    (["--max-body-mb", "-1"], "max_body_mb must be positive"),
    (["--port", "70000"], "port must be in"),
    (["--ctx", "2"], "ctx must be at least"),
    (["--log-level", "loud"], "loud"),
    (["--port", "abc"], "abc"),
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
    text = banner(FakeModel(n_ctx=1024), ServerConfig(port=9123, cors=True))
    assert "fake-model" in text
    assert "context 1024 tokens" in text
    assert "memory 1.1 MiB" in text          # 1e6 weights + 1024 * 100 KV bytes
    assert "http://127.0.0.1:9123 (CORS enabled)" in text
    assert "reachable from other machines" not in text
    assert "reachable from other machines" in banner(FakeModel(), ServerConfig(host="0.0.0.0"))
