"""Which request bodies the JSON endpoints take: Content-Type and Content-Encoding (pure checks
and their 415s in each dialect)."""

from __future__ import annotations

import pytest

from server.httpbody import body_headers_error


@pytest.mark.parametrize("content_type", [
    "application/json", "Application/JSON", "application/json; charset=utf-8", "application/json;charset=\"UTF8\"",
    "application/vnd.api+json",
])
def test_json_content_types_are_accepted(content_type):
    assert body_headers_error(content_type, None) is None
    assert body_headers_error(content_type, "identity") is None


@pytest.mark.parametrize("content_type,encoding,fragment", [
    (None, None, "no Content-Type"),
    ("text/plain;charset=UTF-8", None, "'text/plain' is not supported"),
    ("application/x-www-form-urlencoded", None, "is not supported"),
    ("multipart/form-data; boundary=x", None, "is not supported"),
    ("application/jsonp", None, "is not supported"),
    ("application/json; charset=latin-1", None, "charset 'latin-1' is not supported"),
    ("application/json", "gzip", "Content-Encoding 'gzip' is not supported"),
    ("application/json", "br", "'br'"),
    ("application/json", "gzip, identity", "is not supported"),
])
def test_other_bodies_are_415(content_type, encoding, fragment):
    err = body_headers_error(content_type, encoding)
    assert err is not None and err.status == 415 and fragment in err.message


def test_415_in_each_dialect(client):
    r = client.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = client.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    # GET endpoints take no body and need no Content-Type.
    assert client.get("/v1/models").status_code == 200
