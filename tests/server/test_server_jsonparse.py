"""Hardened JSON body parsing: limits, rejections, surrogate repair, and a fuzz property."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.jsonparse import MAX_DEPTH, JsonBodyError, parse_json_body


def test_plain_object_round_trips():
    doc = {"a": [1, 2.5, None, True, "x\u00e9\U0001f600"], "b": {"c": -3}}
    assert parse_json_body(json.dumps(doc).encode()) == doc


def test_utf8_bom_is_tolerated():
    assert parse_json_body(b"\xef\xbb\xbf{\"a\": 1}") == {"a": 1}


@pytest.mark.parametrize("body", [b"NaN", b"[Infinity]", b'{"t": -Infinity}', b"[1e400]", b"[-1e999]"])
def test_non_finite_numbers_are_rejected(body):
    with pytest.raises(JsonBodyError, match="NaN|range"):
        parse_json_body(body)


def test_duplicate_keys_are_rejected_at_any_level():
    with pytest.raises(JsonBodyError, match="duplicate key 'content'"):
        parse_json_body(b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}')


def test_depth_limit_exact_boundary():
    ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    parse_json_body(ok)
    too_deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(JsonBodyError, match="nested deeper"):
        parse_json_body(too_deep)


def test_many_shallow_objects_are_neither_too_deep_nor_duplicates_unless_one_is():
    """A body of 10,000 sibling objects has more brackets than the depth limit, which makes the
    parser walk it: it is shallow and parses; one repeated key in the last object is found."""
    doc = {"properties": {f"p{i:05d}": {"type": "string"} for i in range(10_000)}}
    raw = json.dumps(doc)
    assert parse_json_body(raw.encode()) == doc
    with pytest.raises(JsonBodyError, match="duplicate key 'type'"):
        parse_json_body((raw[:-3] + ', "type": "x"}}}').encode())
    nested = b'{"a": ' * (MAX_DEPTH + 1) + b"[]" + b"}" * (MAX_DEPTH + 1)  # the innermost array too deep
    with pytest.raises(JsonBodyError, match="nested deeper"):
        parse_json_body(nested)


def test_depth_beyond_interpreter_recursion_limit():
    body = b'{"a":' * 200_000 + b"1" + b"}" * 200_000
    with pytest.raises(JsonBodyError, match="nested deeper"):
        parse_json_body(body)


def test_lone_surrogates_become_replacement_characters():
    got = parse_json_body(b'{"k\\udc00": ["a\\ud800b", "\\ud83d\\ude00", "\\udfff"]}')
    assert got == {"k\ufffd": ["a\ufffdb", "\U0001f600", "\ufffd"]}
    json.dumps(got, ensure_ascii=False).encode("utf-8")  # encodable: no surrogates left


def test_surrogate_repair_cannot_create_duplicate_keys():
    with pytest.raises(JsonBodyError, match="duplicate"):
        parse_json_body(b'{"\\ud800": 1, "\\udc00": 2}')


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b'{"a": "\xc3"}', b'{"a": "\xed\xa0\x80"}'])
def test_invalid_utf8_is_rejected(body):
    with pytest.raises(JsonBodyError, match="UTF-8"):
        parse_json_body(body)


@pytest.mark.parametrize("body", [b"", b"   ", b"{", b'{"a" 1}', b"[1,]", b"'x'"])
def test_malformed_json_is_rejected(body):
    with pytest.raises(JsonBodyError):
        parse_json_body(body)


def test_huge_integer_is_rejected_quickly():
    with pytest.raises(JsonBodyError):
        parse_json_body(b"[" + b"9" * 100_000 + b"]")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_else(raw):
    try:
        value = parse_json_body(raw)
    except JsonBodyError:
        return
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


_json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(_json_text)
def test_valid_json_parses_to_the_same_value(value):
    assert parse_json_body(json.dumps(value).encode()) == value
