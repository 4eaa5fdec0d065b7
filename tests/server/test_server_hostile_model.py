"""ds4-server as a real process with the embedded model, against oversized prompts.

One module-scoped server (`--ctx 2048`, loopback); its peak RSS (VmHWM from /proc) is read
around each request, so a test sees the memory that the request itself cost.
"""
from __future__ import annotations

import json
import time

import pytest

from server_support import model_server_process

pytestmark = pytest.mark.model

PROMPT_MB = 8


@pytest.fixture(scope="module")
def server():
    with model_server_process("--ctx", "2048", "--log-level", "warning") as srv:
        yield srv


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
])
def test_a_prompt_that_cannot_fit_is_refused_fast_and_cheaply(server, path, body):
    text = "word " * (PROMPT_MB * 1024 * 1024 // 5)
    before = server.rss_peak_kib()
    t = time.monotonic()
    status, raw = server.post(path, body(text))
    seconds = time.monotonic() - t
    grown_mib = (server.rss_peak_kib() - before) / 1024
    assert status == 400, raw[:300]
    err = json.loads(raw)["error"]
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    # Tokenizing 8 MB took seconds and about a gigabyte; the body, its parsed form and the
    # rendered text are a few copies of 8 MB.
    assert seconds < 5, seconds
    assert grown_mib < 200, grown_mib
    status, _ = server.get("/health", timeout=5)
    assert status == 200
