"""Chat templates rendered with limits: hostile templates end quickly with ChatTemplateLimitError."""
from __future__ import annotations

import threading
import time
import tracemalloc

import jinja2.sandbox
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
    "tilde chain": "{% set a = 'a' * 10000000 %}{{ (a ~ a ~ a ~ a)|length }}",
    "plus doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "list plus doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "join doubling": "{% set ns = namespace(s=['ab']) %}{% for i in range(40) %}"
                     "{% set ns.s = [ns.s|join, ns.s|join] %}{% endfor %}{{ ns.s|length }}",
}
# Results that used to be built in full (a gigabyte) before their size was checked: refused from
# their arguments, or, for constants, not evaluated when the template compiles.
BUILT_BEFORE_CHECKED = {
    "tilde doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                      "{% endfor %}{{ ns.s|length }}",
    "percent width": "{{ ('%999999999d' % 1)|length }}",
    "percent precision": "{{ ('%.999999999f' % 1.5)|length }}",
    "percent star width": "{{ ('%*d' % (999999999, 1))|length }}",
    "format filter width": "{{ '%999999999d'|format(1)|length }}",
    "str.format width": "{{ '{:>999999999}'.format(1)|length }}",
    "str.format nested width": "{{ '{:>{w}}{:>{w}}{:>{w}}{:>{w}}'.format(1, 2, 3, 4, w=10000000)|length }}",
    "format_map width": "{{ '{x:>999999999}'.format_map({'x': 1})|length }}",
    "join filter": "{% set s = 'a' * 10000000 %}{{ ([s] * 50)|join|length }}",
    "str.join": "{% set s = 'a' * 10000000 %}{{ ''.join([s] * 50)|length }}",
    "indent filter": "{% set s = 'x\n' * 2000000 %}{{ s|indent(100)|length }}",
    "wordwrap filter": "{{ ('ab ' * 5000000)|wordwrap(1, wrapstring='xxxxxxxx')|length }}",
    "tojson indent": "{% set ns = namespace(x=1) %}{% for i in range(500) %}{% set ns.x = [ns.x] %}{% endfor %}"
                     "{{ ns.x|tojson(indent=1000000)|length }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_hit_a_limit_quickly(name):
    t = ChatTemplate.from_source(HOSTILE[name])
    t.limits = RenderLimits(max_seconds=1.0, max_output_chars=16 * 2**20)
    start = time.monotonic()
    with pytest.raises(ChatTemplateLimitError):
        t.render(MESSAGES)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("name", list(BUILT_BEFORE_CHECKED))
def test_oversized_results_are_refused_before_they_are_built(name):
    limits = RenderLimits(max_seconds=5.0, max_output_chars=16 * 2**20)
    tracemalloc.start()
    try:
        t = ChatTemplate.from_source(BUILT_BEFORE_CHECKED[name])
        t.limits = limits
        with pytest.raises(ChatTemplateLimitError) as e:
            t.render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The limit names what was refused, not the output that would have followed.
    assert "output is longer" not in str(e.value)
    assert peak < 400 * 2**20, f"{peak / 2**20:.0f} MiB traced"


def test_constant_expressions_are_not_evaluated_at_compile_time():
    tracemalloc.start()
    try:
        ChatTemplate.from_source("{{ '%999999999d'|format(1) }}{{ 'a'|center(999999999) }}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB traced"


# Ordinary uses of what the limits watch: rendered as jinja's own sandbox renders them (without
# constant folding, which the chat templates do not do either).
ORDINARY = [
    "{{ 'a' ~ 1 ~ [2] ~ none }}|{% set x = 'b' %}{{ x ~ x }}",
    "{{ '%s-%05.1f|%-4d|%%|%x' % ('a', 2.25, 7, 255) }}{{ '%s' % 'one' }}{{ '%.2s' % 'abc' }}",
    "{{ '%(k)s=%(v)03d' % {'k': 'n', 'v': 5} }}{{ 7 % 3 }}{{ 7.5 % 2 }}",
    "{{ '%s and %s'|format('x', 'y') }}{{ '{:>5}|{:<{w}}|{k}'.format(1, 2, w=3, k='z') }}",
    "{{ '{a}-{b:03}'.format_map({'a': 1, 'b': 2}) }}{{ ['a', 'b']|join('-') }}{{ ', '.join(['c', 'd']) }}",
    "{{ 'x\ny'|indent(2, true) }}|{{ 'x\ny'|indent('> ') }}|{{ 'aaa bbb ccc'|wordwrap(4) }}",
    "{{ {'b': [1, {'c': 'é'}], 'a': none}|tojson(indent=2, sort_keys=true) }}{{ 'é'|tojson(ensure_ascii=true) }}",
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m('a') ~ m('b') }}{% set y %}{{ 'q' ~ 'r' }}{% endset %}{{ y }}",
    "{% autoescape true %}{{ '<' ~ 'b' }}{% set m = '<'|e %}{{ m ~ '>' }}{% endautoescape %}",
]


@pytest.mark.parametrize("source", ORDINARY)
def test_ordinary_templates_render_as_in_jinjas_sandbox(source):
    reference = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, optimized=False)
    reference.filters["tojson"] = lambda v, ensure_ascii=False, **kw: __import__("json").dumps(
        v, ensure_ascii=ensure_ascii, **kw)
    assert ChatTemplate.from_source(source).render(MESSAGES) == reference.from_string(source).render()


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
