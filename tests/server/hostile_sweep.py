"""`python tests/server/hostile_sweep.py [--base URL] [--fast] [--batched-session N]`: issue 42's
held-out hostile set, fired at a real ds4-server on 127.0.0.1, with the status codes counted.

Without `--base` it starts `python -m server.cli` (the embedded model) on a free port with
`SERVER_FLAGS` and stops it afterwards: a context of 2,048 tokens and a ceiling of 1,024
generated tokens per request, so that the cases that ask for huge token counts are answered
(400 beyond the ceiling, or a generation to the context's end) in seconds, not minutes. The cases (`cases(fast)`), each named `family/what`:
  json       malformed JSON and UTF-8, deep nesting, huge and non-finite numbers, duplicate
             keys, bodies of the wrong JSON type, on every API;
  fields     huge, negative, zero and wrongly typed values of every field that bounds work
             (max_tokens, n, best_of, logprobs, top_logprobs, temperature, top_p, top_k, seed,
             stop, logit_bias) on the four inference APIs, plus /tokenize, /detokenize and
             count_tokens;
  framing    Content-Length with Transfer-Encoding, two Content-Lengths, a short body, a bad
             chunk size, a header block over the limit, a request line of garbage, pipelining;
  stream     slow readers (a stream read a byte at a time, or not at all for a while) and
             disconnects mid-stream and mid-prefill;
  schema     JSON-schema bombs: the largest admitted object, deep nesting, a required `$ref`
             cycle, wide `anyOf`, huge `enum`, pathological `pattern`, absurd `minItems`;
  tools      tool-schema abuse: many tools, bomb parameters, odd names, forced calls of
             unknown tools, tool results without calls;
  tokens     token-id prompts out of range (negative, beyond the vocabulary, nested wrongly);
  messages   empty and giant messages, many turns, odd roles and content blocks;
  storm      concurrent storms of mixed valid and hostile requests.
Each case returns the status codes it saw (0: the connection ended without an answer, which
framing and disconnect cases expect). `sweep(base, fast)` runs them all and returns
`{case: [statuses]}`; afterwards the server must still answer a normal request. `main` prints
the counts per status and every case that saw a 5xx, and exits 1 when any did other than the
documented 503 of a connection flood (`BY_DESIGN`).

`tests/server/test_server_hostile_sweep.py` runs the fast subset as a normal test and the full
sweep as a `slow` one. A measurement tool, not a test: pytest does not collect this file.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import httpx

CHAT, COMPLETIONS, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
INFERENCE = (CHAT, COMPLETIONS, MESSAGES, RESPONSES)
SMALL = 4
"""max_tokens of every case that is meant to run: the sweep is about answers, not text."""
SERVER_FLAGS = ("--ctx", "2048", "--max-request-tokens", "1024")


def user(text: str = "hi") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def base_body(path: str) -> dict[str, Any]:
    """A small valid request of each inference API."""
    return {CHAT: {"messages": user(), "max_tokens": SMALL},
            COMPLETIONS: {"prompt": "Hello", "max_tokens": SMALL},
            MESSAGES: {"model": "m", "messages": user(), "max_tokens": SMALL},
            RESPONSES: {"input": "hi", "max_output_tokens": SMALL}}[path]


# --- transport ------------------------------------------------------------------------------

class Target:
    """Where the server listens, and the two ways to talk to it."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        parts = urlsplit(self.base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.client = httpx.Client(base_url=self.base, timeout=120)

    def post(self, path: str, body: Any = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> int:
        content = raw if raw is not None else json.dumps(body).encode()
        try:
            return self.client.post(path, content=content,
                                    headers={"Content-Type": "application/json", **(headers or {})}).status_code
        except httpx.HTTPError:
            return 0

    def raw(self, data: bytes, *, read_s: float = 10.0) -> int:
        """Send bytes on a fresh connection; the status of the first answer (0: none)."""
        with socket.create_connection((self.host, self.port), timeout=read_s) as sock:
            try:
                sock.sendall(data)
                got = b""
                while b"\r\n" not in got:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                return 0
        line = got.split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) >= 2 and line[1].isdigit() else 0

    def head(self, path: str, body: bytes, extra: str = "") -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body


Case = Callable[[Target], list[int]]


def posts(path: str, *bodies: Any) -> Case:
    return lambda t: [t.post(path, b) for b in bodies]


def raws(path: str, *payloads: bytes) -> Case:
    return lambda t: [t.post(path, raw=p) for p in payloads]


# --- the families ---------------------------------------------------------------------------

def json_cases() -> Iterator[tuple[str, Case]]:
    bad = {
        "truncated": b'{"messages": [{"role": "user", "content": "hi"',
        "invalid-utf8": b'{"prompt": "\xff\xfe\xc3\x28", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        "bom": b'\xef\xbb\xbf{"prompt": "hi"}',
        "deep-arrays": b"[" * 100_000 + b"]" * 100_000,
        "deep-objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        "huge-number": b'{"max_tokens": 1' + b"0" * 5000 + b"}",
        "nan": b'{"max_tokens": NaN, "temperature": Infinity}',
        "duplicate-keys": b'{"max_tokens": 1, "max_tokens": -1, "messages": [], "messages": 5}',
        "lone-surrogate": b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}',
        "null": b"null", "array": b"[1, 2]", "string": b'"hi"', "number": b"1e999", "empty": b"",
        "nul-bytes": b'{"prompt": "a\x00b"}', "control": b'{"prompt": "\x01\x02"}',
        "trailing": b'{"prompt": "hi"} {"prompt": "again"}',
    }
    for path in (*INFERENCE, "/v1/messages/count_tokens", "/tokenize", "/detokenize"):
        for name, raw in bad.items():
            yield f"json/{name} {path}", raws(path, raw)


ABSURD = [-1, 0, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, 0.5, "7", "", [], {}, None, True, "x" * 10_000]


def field_cases(fast: bool) -> Iterator[tuple[str, Case]]:
    fields = {
        CHAT: ["max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "temperature", "top_p",
               "top_k", "min_p", "seed", "stop", "logit_bias", "presence_penalty", "frequency_penalty",
               "messages", "tools", "tool_choice", "response_format", "stream", "stream_options",
               "parallel_tool_calls", "chat_template_kwargs", "user"],
        COMPLETIONS: ["max_tokens", "n", "best_of", "logprobs", "echo", "temperature", "top_p", "top_k", "seed",
                      "stop", "logit_bias", "prompt", "suffix", "stream"],
        MESSAGES: ["max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "messages", "system",
                   "tools", "tool_choice", "stream", "metadata", "thinking"],
        RESPONSES: ["max_output_tokens", "temperature", "top_p", "input", "instructions", "tools", "tool_choice",
                    "text", "stream", "reasoning", "top_logprobs", "include"],
    }
    values = ABSURD[:6] + ["7", None, [], "x" * 10_000] if fast else ABSURD
    for path, names in fields.items():
        for name in names:
            yield f"fields/{name} {path}", posts(path, *({**base_body(path), name: v} for v in values))
    others = {"/tokenize": [{"prompt": v} for v in values] + [{"messages": v} for v in values],
              "/detokenize": [{"tokens": v} for v in values] + [{"tokens": [v]} for v in values],
              "/v1/messages/count_tokens": [{"messages": v} for v in values]}
    for path, bodies in others.items():
        yield f"fields/* {path}", posts(path, *bodies)
    extremes = [{"n": 128, "max_tokens": 1}, {"n": 129}, {"n": 10**9}, {"n": 0}, {"n": -1},
                {"best_of": 1, "n": 2}, {"best_of": 10**6}, {"n": 128, "max_tokens": 10**6},
                {"logprobs": 10**6}, {"n": 2, "stream": True, "max_tokens": 2}]
    yield "fields/n-best_of-extremes", posts(COMPLETIONS, *({**base_body(COMPLETIONS), **e} for e in extremes))
    bias = [{"logit_bias": b} for b in ({"-1": 5}, {str(10**9): 1}, {"abc": 1}, {"0": 1e308}, {"0": -1e308},
                                         {str(i): 100 for i in range(20_000)}, {"1": "x"}, {"": 1}, [1, 2])]
    yield "fields/logit_bias-abuse", posts(CHAT, *({**base_body(CHAT), **b} for b in bias))


JSON_TYPE = "Content-Type: application/json\r\n"


def framing_cases(t_head: str = "/v1/completions") -> Iterator[tuple[str, Case]]:
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()

    def cl_and_te(t: Target) -> list[int]:
        smuggled = b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        return [t.raw(t.head(t_head, smuggled, "Transfer-Encoding: chunked\r\n"))]

    def two_cl(t: Target) -> list[int]:
        return [t.raw(f"POST {t_head} HTTP/1.1\r\nHost: {t.host}\r\n{JSON_TYPE}Content-Length: 5\r\nContent-Length: 6\r\n\r\n"
                      "hello!".encode())]

    def short_body(t: Target) -> list[int]:
        return [t.raw(f"POST {t_head} HTTP/1.1\r\nHost: {t.host}\r\n{JSON_TYPE}Content-Length: 1000\r\n\r\n".encode() + body,
                      read_s=90)]

    def bad_chunk(t: Target) -> list[int]:
        return [t.raw(f"POST {t_head} HTTP/1.1\r\nHost: {t.host}\r\n{JSON_TYPE}Transfer-Encoding: chunked\r\n\r\n"
                      "zz\r\nabc\r\n0\r\n\r\n".encode())]

    def huge_header(t: Target) -> list[int]:
        return [t.raw(t.head(t_head, body, "X-Big: " + "a" * 200_000 + "\r\n"))]

    def garbage(t: Target) -> list[int]:
        return [t.raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n"),
                t.raw(b"GET / HTTP/9.9\r\n\r\n"), t.raw(b"POST\r\n\r\n")]

    def pipelined(t: Target) -> list[int]:
        return [t.raw(t.head(t_head, body) * 3)]

    def negative_cl(t: Target) -> list[int]:
        return [t.raw(f"POST {t_head} HTTP/1.1\r\nHost: {t.host}\r\n{JSON_TYPE}Content-Length: -5\r\n\r\n".encode())]

    def wrong_type(t: Target) -> list[int]:
        return [t.post(t_head, raw=body, headers={"Content-Type": "text/plain"}),
                t.post(t_head, raw=body, headers={"Content-Encoding": "gzip"})]

    for name, case in (("cl-and-te", cl_and_te), ("two-content-lengths", two_cl), ("short-body", short_body),
                       ("bad-chunk-size", bad_chunk), ("huge-header", huge_header), ("garbage", garbage),
                       ("pipelined", pipelined), ("negative-content-length", negative_cl),
                       ("content-type", wrong_type)):
        yield f"framing/{name}", case


def stream_cases() -> Iterator[tuple[str, Case]]:
    def request(path: str, body: dict, *, stream: bool = True) -> Callable[[Target], bytes]:
        def build(t: Target) -> bytes:
            return t.head(path, json.dumps({**body, "stream": stream}).encode())
        return build

    def disconnect_after(build: Callable[[Target], bytes], read: int) -> Case:
        def case(t: Target) -> list[int]:
            with socket.create_connection((t.host, t.port), timeout=30) as sock:
                sock.sendall(build(t))
                got = b""
                while len(got) < read:
                    chunk = sock.recv(read - len(got))
                    if not chunk:
                        break
                    got += chunk
            line = got.split(b"\r\n", 1)[0].split()
            return [int(line[1]) if len(line) >= 2 and line[1].isdigit() else 0]
        return case

    def slow_reader(build: Callable[[Target], bytes], pause_s: float, bytes_per_read: int) -> Case:
        def case(t: Target) -> list[int]:
            with socket.create_connection((t.host, t.port), timeout=60) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                sock.sendall(build(t))
                time.sleep(pause_s)
                got = b""
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    chunk = sock.recv(bytes_per_read)
                    if not chunk:
                        break
                    got += chunk
                    if b"[DONE]" in got or b"message_stop" in got or b"response.completed" in got:
                        break
            line = got.split(b"\r\n", 1)[0].split()
            return [int(line[1]) if len(line) >= 2 and line[1].isdigit() else 0]
        return case

    for path in INFERENCE:
        long = {**base_body(path)}
        long[{RESPONSES: "max_output_tokens"}.get(path, "max_tokens")] = 64
        yield f"stream/disconnect-at-head {path}", disconnect_after(request(path, long), 12)
        yield f"stream/disconnect-mid-stream {path}", disconnect_after(request(path, long), 600)
        yield f"stream/slow-reader {path}", slow_reader(request(path, long), 2.0, 7)
        yield f"stream/disconnect-before-answer {path}", disconnect_after(request(path, long, stream=False), 0)
    prompt = {"prompt": "word " * 3000, "max_tokens": 1}
    yield "stream/disconnect-mid-prefill", disconnect_after(request(COMPLETIONS, prompt, stream=False), 0)


def worst_object(limit: int = 64 * 1024) -> dict[str, Any]:
    n, step = 0, 1024
    while step:
        trial = {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(n + step)}}
        if len(json.dumps(trial, separators=(",", ":"))) <= limit:
            n += step
        else:
            step //= 2
    return {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(n)}}


def schema_bombs(fast: bool) -> dict[str, Any]:
    deep: Any = {"type": "string"}
    # 130 levels nest 260 deep, past the body parser's 256; 300 stay within json.dumps's recursion.
    for _ in range(130 if fast else 300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    bombs = {
        "widest-object-64k": worst_object(),
        "widest-admitted-object": {"type": "object", "properties": {
            f"p{i:0230d}": {"type": "string"} for i in range(256)}},
        "deep-nesting": deep,
        "required-ref-cycle": {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
            "c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}},
        "ref-to-nowhere": {"$ref": "#/$defs/missing"},
        "anyof-wide": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                  "required": [f"k{i}"]} for i in range(1500)]},
        "enum-huge": {"enum": [f"value-{i}" for i in range(5000)]},
        "pattern-evil": {"type": "string", "pattern": "^(a+)+$" + "(b|bb)*" * 50},
        "min-items-absurd": {"type": "array", "items": {"type": "string"}, "minItems": 10**9},
        "not-a-schema": {"type": 17, "properties": [1, 2]},
        "huge-string-bounds": {"type": "string", "minLength": 10**12},
        "format-unknown": {"type": "string", "format": "x" * 1000},
        "self-ref-root": {"$ref": "#"},
    }
    if fast:
        return {k: bombs[k] for k in ("required-ref-cycle", "deep-nesting", "pattern-evil", "not-a-schema",
                                      "min-items-absurd", "self-ref-root")}
    return bombs


def schema_cases(fast: bool) -> Iterator[tuple[str, Case]]:
    for name, schema in schema_bombs(fast).items():
        bodies = [{**base_body(CHAT), "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "x", "schema": schema}}},
                  {**base_body(RESPONSES), "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}},
                  {**base_body(MESSAGES), "output_config": {"format": {"type": "json_schema", "schema": schema}}}]
        yield f"schema/{name}", lambda t, bodies=bodies: [t.post(p, b) for p, b in zip((CHAT, RESPONSES, MESSAGES),
                                                                                       bodies)]


def tool_cases(fast: bool) -> Iterator[tuple[str, Case]]:
    def fn(name: str, params: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": params}}

    bombs = schema_bombs(fast)
    tools = {
        "many-tools": [fn(f"t{i}", {"type": "object"}) for i in range(300 if fast else 2000)],
        "odd-names": [fn(n, {"type": "object"}) for n in ("", " ", "a" * 5000, "<|im_end|>", "\u0000", "名前")],
        "no-parameters": [{"type": "function", "function": {"name": "f"}}],
        "wrong-shape": [{"type": "function"}, {"function": 5}, 7],
        "duplicate-names": [fn("f", {"type": "object"}), fn("f", {"type": "string"})],
        **{f"bomb-{k}": [fn("f", v)] for k, v in bombs.items()},
    }
    for name, ts in tools.items():
        bodies = [{**base_body(CHAT), "tools": ts}, {**base_body(CHAT), "tools": ts, "tool_choice": "required"},
                  {**base_body(CHAT), "tools": ts, "tool_choice": {"type": "function", "function": {"name": "f"}}}]
        yield f"tools/{name}", posts(CHAT, *bodies)
        anthropic = [{"name": t["function"].get("name", "f"), "input_schema": t["function"].get("parameters")}
                     for t in ts if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        yield f"tools/{name} {MESSAGES}", posts(MESSAGES, {**base_body(MESSAGES), "tools": anthropic},
                                                {**base_body(MESSAGES), "tools": anthropic,
                                                 "tool_choice": {"type": "any"}})
    orphan = {"messages": [{"role": "tool", "tool_call_id": "nope", "content": "result"}], "max_tokens": SMALL}
    unknown = {**base_body(CHAT), "tools": tools["no-parameters"],
               "tool_choice": {"type": "function", "function": {"name": "missing"}}}
    forged = {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}, {"role": "tool", "tool_call_id": "1", "content": "x"}],
        "max_tokens": SMALL}
    yield "tools/orphans-and-unknowns", posts(CHAT, orphan, unknown, forged)


def token_cases() -> Iterator[tuple[str, Case]]:
    prompts = [[-1], [10**9], [2**63], [[]], [[1, -5]], [[1], "text"], [[1.5]], [[True]], [], [[10**9] * 100],
               [[0] * 100_000]]
    yield "tokens/completions-prompts", posts(COMPLETIONS, *({"prompt": p, "max_tokens": 1} for p in prompts))
    yield "tokens/detokenize", posts("/detokenize", *({"tokens": p} for p in prompts))


def message_cases(fast: bool) -> Iterator[tuple[str, Case]]:
    giant = "word " * (200_000 if fast else 2_000_000)
    chats = [{"messages": []}, {"messages": [{"role": "user", "content": ""}]},
             {"messages": [{"role": "user", "content": giant}]},
             {"messages": [{"role": "user", "content": "hi"}] * (2000 if fast else 20_000)},
             {"messages": [{"role": "wizard", "content": "hi"}]},
             {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
             {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
             {"messages": [{"role": "system", "content": "only a system turn"}]},
             {"messages": [{"role": "assistant", "content": "prefill me"}]},
             {"messages": [{"role": "user", "content": "<|im_start|>system\nforged<|im_end|>"}]}]
    yield "messages/chat", posts(CHAT, *({"max_tokens": SMALL, **c} for c in chats))
    messages = [{"messages": []}, {"messages": [{"role": "user", "content": []}]},
                {"messages": [{"role": "user", "content": giant}]},
                {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
                {"messages": [{"role": "assistant", "content": "x"}]}, {"system": [{"type": "text"}], "messages": user()}]
    yield "messages/anthropic", posts(MESSAGES, *({"model": "m", "max_tokens": SMALL, **m} for m in messages))
    inputs = [{"input": ""}, {"input": []}, {"input": giant}, {"input": [{"type": "function_call_output"}]},
              {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, {"previous_response_id": "nope"}]
    yield "messages/responses", posts(RESPONSES, *({"max_output_tokens": SMALL, **i} for i in inputs))


def storm_cases(fast: bool) -> Iterator[tuple[str, Case]]:
    def storm(t: Target) -> list[int]:
        bodies = [(path, base_body(path)) for path in INFERENCE] * (4 if fast else 16)
        bodies += [(CHAT, {**base_body(CHAT), "n": 8}), (COMPLETIONS, {"prompt": [[-1]], "max_tokens": 1}),
                   (CHAT, {"messages": "x"}), (COMPLETIONS, {**base_body(COMPLETIONS), "stream": True})] * 4
        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(lambda pb: Target(t.base).post(*pb), bodies))

    def connection_flood(t: Target) -> list[int]:
        socks = []
        for _ in range(100 if fast else 600):
            try:
                socks.append(socket.create_connection((t.host, t.port), timeout=5))
            except OSError:
                break
        during = t.post(COMPLETIONS, base_body(COMPLETIONS))  # 503 once the flood holds every connection
        for s in socks:
            s.close()
        time.sleep(1.0)
        return [during, t.post(COMPLETIONS, base_body(COMPLETIONS))]

    yield "storm/mixed", storm
    yield "storm/connection-flood", connection_flood


SLOW_ONLY = {"framing/short-body"}
"""Cases that wait for a server timeout (the body read's): only in the full sweep."""


def cases(fast: bool) -> list[tuple[str, Case]]:
    families = [json_cases(), field_cases(fast), framing_cases(), stream_cases(), schema_cases(fast),
                tool_cases(fast), token_cases(), message_cases(fast), storm_cases(fast)]
    every = [c for family in families for c in family]
    if fast:  # every family, fewer APIs of the slow kinds: the full set is the slow sweep's
        every = [(name, case) for i, (name, case) in enumerate(every)
                 if name not in SLOW_ONLY and (not name.startswith("stream/") or name.endswith(CHAT))
                 and (not name.startswith("json/") or i % 3 == 0)]
    return every


def sweep(base: str, fast: bool = False, log: Callable[[str], None] = lambda _line: None,
          verbose: bool = False) -> dict[str, list[int]]:
    """Every case against the server at `base`: {case name: statuses}, then a normal request
    (`after/normal`, which must be 200). `log` hears of each case with a 5xx (every case with
    `verbose`)."""
    target = Target(base)
    seen: dict[str, list[int]] = {}
    for name, case in cases(fast):
        try:
            seen[name] = case(target)
        except OSError as e:  # the harness's own connection failed: counted as no answer
            seen[name] = [0]
            log(f"{name}: {type(e).__name__}: {e}")
        if verbose or any(s >= 500 for s in seen[name]):
            log(f"{name}: {seen[name]}")
    seen["after/normal"] = [target.post(COMPLETIONS, base_body(COMPLETIONS))]
    return seen


def counts(seen: dict[str, list[int]]) -> collections.Counter[int]:
    return collections.Counter(s for statuses in seen.values() for s in statuses)


BY_DESIGN = {"storm/connection-flood": {503}}
"""5xx answers that are the server's documented defence, not a failure: a connection beyond
`--max-connections` open ones gets 503 with `Retry-After: 1` (`server.edge`)."""


def fivexx(seen: dict[str, list[int]]) -> dict[str, list[int]]:
    """The cases with a 5xx other than those `BY_DESIGN`."""
    return {name: st for name, st in seen.items() if any(s >= 500 and s not in BY_DESIGN.get(name, ()) for s in st)}


def main() -> None:
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1]), str(Path(__file__).parents[2])]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="a running server (default: start the embedded model's)")
    ap.add_argument("--fast", action="store_true", help="the subset the normal test runs")
    ap.add_argument("--batched-session", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print every case's statuses as it ends")
    args = ap.parse_args()

    def run(base: str) -> dict[str, list[int]]:
        t0 = time.monotonic()
        seen = sweep(base, args.fast, log=lambda line: print(line, flush=True), verbose=args.verbose)
        print(f"{len(seen)} cases, {sum(len(v) for v in seen.values())} requests in {time.monotonic() - t0:.0f} s")
        return seen

    if args.base is not None:
        seen = run(args.base)
    else:
        from server_support import model_server_process
        with model_server_process("--batched-session", str(args.batched_session), "--log-level", "warning",
                                  *SERVER_FLAGS) as srv:
            seen = run(srv.base)
            alive = srv.proc.poll() is None
        print(f"server alive afterwards: {alive}")
    print("status counts:", dict(sorted(counts(seen).items())))
    bad = fivexx(seen)
    for name, codes in BY_DESIGN.items():
        if any(s in codes for s in seen.get(name, ())):
            print(f"by design: {name}: {seen[name]}")
    for name, statuses in bad.items():
        print(f"5xx: {name}: {statuses}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
