"""Chat templates rendered with limits: hostile templates end quickly with ChatTemplateLimitError."""
from __future__ import annotations

import threading
import time

import pytest

from engine.chat_template import (ChatTemplate, ChatTemplateError, ChatTemplateLimitError, ChatTemplateRejected,
                                  RenderLimits)

MESSAGES = [{"role": "user", "content": "hi"}]
HOSTILE = {
    "string repetition": "{{ 'a' * 2**31 }}",
    "list repetition": "{{ ([1] * 2**30)|length }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge range": "{% for i in range(10**9) %}{% endfor %}",
    "loops over a long string": "{% set s = 'a' * 1000000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}",
    "center filter": "{{ 'a'|center(2**31) }}",
    "ljust method": "{{ 'a'.ljust(2000000000) }}",
    "replace growth": "{% set s = 'a' * 1000000 %}{{ s|replace('a', 'b' * 1000) }}",
    "power": "{{ 10 ** 100000000 }}",
    "concatenation": "{% set a = 'a' * 40000000 %}{% set b = a + a %}{{ b + b }}",
    "output length": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_hit_a_limit_quickly(name):
    t = ChatTemplate.from_source(HOSTILE[name])
    t.limits = RenderLimits(max_seconds=1.0, max_output_chars=16 * 2**20)
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError):
        t.render(MESSAGES)
    assert time.monotonic() - start < 3


def test_raise_exception_is_a_rejection():
    with pytest.raises(ChatTemplateRejected, match="roles must alternate"):
        ChatTemplate.from_source("{{ raise_exception('roles must alternate') }}").render(MESSAGES)


def test_an_aborted_render_leaves_the_thread_usable():
    slow = ChatTemplate.from_source(HOSTILE["loops over a long string"])
    slow.limits = RenderLimits(max_seconds=0.3)
    ok = ChatTemplate.from_source("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    results = []

    def run():
        for _ in range(3):
            try:
                slow.render(MESSAGES)
            except ChatTemplateError as e:
                results.append(type(e).__name__)
            results.append(ok.render(MESSAGES))
            time.sleep(0.8)  # a stray abort would arrive in here
        results.append("done")

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert results == ["ChatTemplateLimitError", "hi"] * 3 + ["done"]


def test_probe_renders_a_small_conversation():
    ChatTemplate.from_source("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}").probe()
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_source("{{ messages[0]['content'].nope() }}").probe()


def test_ordinary_templates_are_untouched_by_the_limits():
    t = ChatTemplate.from_source("{% for i in range(3) %}{{ i }}{% endfor %}{{ range(5)|list|length }}"
                                 "{{ 'ab' * 3 }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ 'a b'.split()|join(',') }}"
                                 "{% for i in range(4)|reverse %}{{ i }}{% endfor %}")
    assert t.render(MESSAGES) == "0125ababab[1, 2, 3]1024a,b3210"
