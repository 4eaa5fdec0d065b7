"""ds4-server and ds4 with a GGUF whose chat template is hostile or broken (tiny random models)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine import load_model
from engine.chat_template import RenderLimits
from engine.synthetic import RandomModelSpec, write_random_gguf
from server.app import create_app
from server.config import ServerConfig
from server_support import TEST_CLIENT_HOST

REPO = Path(__file__).resolve().parents[2]
BURNS_CPU = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RAISES = "{{ raise_exception('this template is broken') }}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def gguf(tmp_path_factory, template: str) -> str:
    spec = RandomModelSpec(seed=5, extra_metadata={"tokenizer.chat_template": template})
    return str(write_random_gguf(tmp_path_factory.mktemp("g") / "t.gguf", spec))


@pytest.fixture(scope="module")
def burner(tmp_path_factory):
    return gguf(tmp_path_factory, BURNS_CPU)


def test_a_cpu_burning_template_is_aborted_and_reported(tmp_path_factory):
    # The probe at startup already hits the limit: chat is off, completions are served.
    model = load_model(gguf(tmp_path_factory, BURNS_CPU))
    model.template.limits = RenderLimits(max_seconds=0.5)
    with TestClient(create_app(model, ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,))), raise_server_exceptions=False) as c:
        start = time.monotonic()
        r = c.post("/v1/chat/completions", json=CHAT)
        assert time.monotonic() - start < 2
        assert r.status_code == 500 and "chat template" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_template_that_raises_is_reported_at_startup_in_one_line(tmp_path_factory, caplog):
    model = load_model(gguf(tmp_path_factory, RAISES))
    with caplog.at_level(logging.WARNING, logger="ds4.server"):
        app = create_app(model, ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,)))
    lines = [r.getMessage() for r in caplog.records if "probe render" in r.getMessage()]
    assert len(lines) == 1 and "this template is broken" in lines[0] and "\n" not in lines[0]
    with TestClient(app, raise_server_exceptions=False) as c:
        for path, body in [("/v1/chat/completions", CHAT), ("/v1/messages", CHAT),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 2})]:
            r = c.post(path, json=body)
            assert r.status_code == 500 and "this template is broken" in r.text, (path, r.text)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_template_that_burns_cpu_only_on_some_requests_is_aborted_per_request(tmp_path_factory):
    picky = ("{% for m in messages %}{% if m['content'] == 'spin' %}"
             "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "{% endif %}{{ m['content'] }}{% endfor %}")
    model = load_model(gguf(tmp_path_factory, picky))
    model.template.limits = RenderLimits(max_seconds=0.5)
    with TestClient(create_app(model, ServerConfig(allowed_hosts=(TEST_CLIENT_HOST,))), raise_server_exceptions=False) as c:
        start = time.monotonic()
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "spin"}], "max_tokens": 2})
        assert r.status_code == 500 and "longer than" in r.json()["error"]["message"]
        assert time.monotonic() - start < 3
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_ds4_stops_a_hostile_template_with_a_one_line_error(burner, monkeypatch):
    """The `ds4` command in-process, with the render limit cut to 0.5 s; the real process at
    the 10 s default is the slow test below."""
    from click.testing import CliRunner

    import engine
    from engine import cli

    def load_with_a_short_limit(*args, **kw):
        model = load_model(*args, **kw)
        model.template.limits = RenderLimits(max_seconds=0.5)
        return model

    monkeypatch.setattr(engine, "load_model", load_with_a_short_limit)
    start = time.monotonic()
    r = CliRunner().invoke(cli.main, ["-m", burner, "-p", "hi", "-n", "2"])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().startswith("ds4: error:") and "chat template render took longer than 0.5 s" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_ds4_stops_a_hostile_template_at_the_default_limit_in_its_own_process(burner):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "engine", "-m", burner, "-p", "hi", "-n", "2"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().startswith("ds4: error:") and "chat template" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # The default render limit is 10 s; the rest is starting Python and torch on a busy machine.
    assert time.monotonic() - start < 150
