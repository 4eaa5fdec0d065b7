"""`ds4-eval data pull`: fetch the upstream C case tables and convert them to the data directory's jsonl.

Contract
- `parse_c_tables(source) -> list[dict]` reads C source as data: it finds every array whose
  elements are designated initializers with a `.question` field and returns one case object
  per element. It understands string-literal concatenation, C escapes (octal and hex bytes
  decode as UTF-8), `.choice[i]` / `.alias[i]` arrays, enum names for the answer kind and
  `|`-joined suite flags, integers, comments and preprocessor lines. It never compiles or runs
  anything. Missing answer kinds are inferred the way the upstream tables imply them
  (options: choice; COMPSEC: line_set; an integer key: integer; else exact_text); cases of a
  table without suite flags belong to `core`.
- `pull(base_url, data_dir)` downloads `UPSTREAM_FILES` (relative to `base_url` when given),
  converts them, checks every case parses, then writes core.jsonl and hard.jsonl atomically
  (temporary files renamed into place only after everything succeeded).
It does not validate against the manifests; `ds4-eval validate` does that.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import httpx

from ds4eval.cases import case as cs

# Pinned revisions of the curated tables (see suites/*/manifest.json "upstream").
UPSTREAM_FILES = (
    ("https://raw.githubusercontent.com/antirez/ds4/8d57664", "ds4_eval.c"),
    ("https://raw.githubusercontent.com/zzyu17/ds4/93998b2", "ds4_eval_cases.c"),
)

_SUITE_FLAGS = {"EVAL_SUITE_CORE": "core", "EVAL_SUITE_HARD": "hard", "EVAL_SUITE_HARD_SMOKE": "hard-smoke"}
_ARRAY_FIELDS = {"choice": "choices", "choices": "choices", "alias": "aliases", "aliases": "aliases"}


class PullError(Exception):
    pass


class CParseError(ValueError):
    pass


# ---------------------------------------------------------------- lexer

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>/\*.*?\*/|//[^\n]*)
  | (?P<pp>\#[^\n]*(?:\\\n[^\n]*)*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<number>0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct>[{}\[\]=,.;|()*&+\-<>/:?!~%^@$`\\])
""", re.S | re.M | re.X)

_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "0": 0, "a": 7, "b": 8, "f": 12, "v": 11,
                   "\\": 92, '"': 34, "'": 39, "?": 63}


def _decode_c_string(lit: str) -> bytes:
    body = lit[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode("utf-8")
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in "01234567":
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            out.append(int(m.group(0), 8) & 0xFF)
            i += 1 + len(m.group(0))
        elif nxt == "x":
            m = re.match(r"[0-9a-fA-F]+", body[i + 2:])
            if not m:
                raise CParseError("\\x without hex digits")
            out.append(int(m.group(0), 16) & 0xFF)
            i += 2 + len(m.group(0))
        elif nxt in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[nxt])
            i += 2
        else:
            out += nxt.encode("utf-8")  # unknown escapes keep the character, as compilers do
            i += 2
    return bytes(out)


def _tokens(source: str) -> list[tuple[str, str]]:
    toks, pos = [], 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if not m:
            line = source.count("\n", 0, pos) + 1
            raise CParseError(f"line {line}: unexpected character {source[pos]!r}")
        kind = m.lastgroup
        if kind not in ("ws", "comment", "pp"):
            toks.append((kind, m.group(0)))
        pos = m.end()
    return toks


# ---------------------------------------------------------------- initializer parser

class _Parser:
    def __init__(self, toks):
        self.t, self.i = toks, 0

    def peek(self, k=0):
        j = self.i + k
        return self.t[j] if j < len(self.t) else ("eof", "")

    def take(self, value=None):
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise CParseError(f"expected {value!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def value(self):
        """A scalar or braced initializer: bytes (strings), int, list[str] (flags), dict/list."""
        kind, text = self.peek()
        if text == "{":
            return self.braced()
        if kind == "string":
            data = b""
            while self.peek()[0] == "string":
                data += _decode_c_string(self.take()[1])
            return data
        if kind == "number":
            self.take()
            return int(text.rstrip("uUlL"), 0)
        if kind == "ident":
            names = [self.take()[1]]
            while self.peek()[1] == "|":
                self.take("|")
                names.append(self.take()[1])
            return names
        if text == "(":  # a parenthesised expression: keep it opaque
            depth = 0
            while True:
                _, t = self.take()
                depth += t == "("
                depth -= t == ")"
                if depth == 0:
                    return None
        raise CParseError(f"unexpected token {text!r}")

    def braced(self):
        self.take("{")
        fields: dict = {}
        items: list = []
        while self.peek()[1] != "}":
            if self.peek()[1] == ".":
                self.take(".")
                name = self.take()[1]
                idx = None
                if self.peek()[1] == "[":
                    self.take("[")
                    idx = int(self.take()[1], 0)
                    self.take("]")
                self.take("=")
                val = self.value()
                if idx is None:
                    fields[name] = val
                else:
                    fields.setdefault(name, {})[idx] = val
            else:
                items.append(self.value())
            if self.peek()[1] == ",":
                self.take(",")
            elif self.peek()[1] != "}":
                raise CParseError(f"expected ',' or '}}', got {self.peek()[1]!r}")
        self.take("}")
        return fields if fields else items


def _array_initializers(toks):
    """Yield (array name, parsed initializer list) for every `name[...] = { ... }` definition."""
    p = _Parser(toks)
    while p.i < len(toks):
        kind, text = p.peek()
        if kind == "ident" and p.peek(1)[1] == "[":
            j = 2
            while p.peek(j)[1] not in ("]", "eof", ";"):
                j += 1
            if p.peek(j)[1] == "]" and p.peek(j + 1)[1] == "=" and p.peek(j + 2)[1] == "{":
                p.i += j + 2
                yield text, p.braced()
                continue
        p.i += 1


def _text(v, field: str) -> str:
    if not isinstance(v, bytes):
        raise CParseError(f"field .{field} is not a string")
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        raise CParseError(f"field .{field} is not valid UTF-8") from None


def _indexed(v, field: str) -> list[str]:
    if isinstance(v, dict):
        if sorted(v) != list(range(len(v))):
            raise CParseError(f".{field}[] has gaps")
        return [_text(v[k], field) for k in sorted(v)]
    if isinstance(v, list):
        return [_text(x, field) for x in v]
    raise CParseError(f"field .{field} is not an array")


def _infer_kind(obj: dict) -> str:
    if obj["choices"]:
        return "choice"
    if obj["source"] == "COMPSEC":
        return "line_set"
    if re.fullmatch(r"-?\d+", obj["answer"]):
        return "integer"
    return "exact_text"


def convert_case(fields: dict) -> dict:
    """One designated initializer (already parsed) -> a case object in the jsonl format."""
    obj: dict = {"choices": [], "aliases": []}
    for name, v in fields.items():
        if name in _ARRAY_FIELDS:
            obj[_ARRAY_FIELDS[name]] = _indexed(v, name)
        elif name in ("source", "id", "domain", "title", "question", "answer"):
            obj[name] = _text(v, name)
        elif name == "answer_kind":
            if not isinstance(v, list) or len(v) != 1 or not v[0].startswith("EVAL_ANSWER_"):
                raise CParseError(f"bad .answer_kind {v!r}")
            obj["answer_kind"] = v[0][len("EVAL_ANSWER_"):].lower()
        elif name == "suites":
            if not isinstance(v, list) or any(f not in _SUITE_FLAGS for f in v):
                raise CParseError(f"bad .suites {v!r}")
            obj["suites"] = [_SUITE_FLAGS[f] for f in v]
        elif name == "max_tokens":
            if not isinstance(v, int):
                raise CParseError(".max_tokens is not an integer")
            obj["max_tokens"] = v
        # Other fields (rationales, notes) are upstream bookkeeping, not case content.
    for name in ("source", "id", "question", "answer"):
        if name not in obj:
            raise CParseError(f"case without .{name}")
    obj.setdefault("domain", "")
    obj.setdefault("title", "")
    obj.setdefault("answer_kind", _infer_kind(obj))
    obj.setdefault("suites", ["core"])
    return obj


def parse_c_tables(source: str) -> list[dict]:
    out = []
    for _name, init in _array_initializers(_tokens(source)):
        if not isinstance(init, list):
            continue
        for el in init:
            if isinstance(el, dict) and "question" in el:
                try:
                    out.append(convert_case(el))
                except CParseError as e:
                    raise CParseError(f"case {el.get('id', b'?')!r}: {e}") from None
    return out


# ---------------------------------------------------------------- fetching and writing

def fetch(url: str, timeout: float = 60.0) -> str:
    try:
        r = httpx.get(url, timeout=timeout, follow_redirects=True)
    except httpx.HTTPError as e:
        raise PullError(f"cannot fetch {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise PullError(f"cannot fetch {url}: HTTP {r.status_code}")
    return r.content.decode("utf-8", errors="strict")


def split_by_file(objs: list[dict]) -> dict[str, list[dict]]:
    """Group case objects by the data file their suites live in, keeping table order."""
    files: dict[str, list[dict]] = {}
    for obj in objs:
        for name in dict.fromkeys(cs.SUITE_DATA_FILE[s] for s in obj["suites"] if s in cs.SUITE_DATA_FILE):
            files.setdefault(name, []).append(obj)
    return files


def pull(base_url: str | None, data_dir: Path) -> list[tuple[Path, int]]:
    """Fetch, convert and atomically write the data files; returns (path, case count) pairs."""
    objs: list[dict] = []
    for default_base, filename in UPSTREAM_FILES:
        base = (base_url or default_base).rstrip("/")
        url = f"{base}/{filename}"
        try:
            objs.extend(parse_c_tables(fetch(url)))
        except (CParseError, UnicodeDecodeError) as e:
            raise PullError(f"{url}: cannot read the case table: {e}") from None
    for obj in objs:
        try:
            cs.parse_case(obj)
        except cs.CaseError as e:
            raise PullError(f"upstream case {obj.get('source')}/{obj.get('id')}: {e}") from None
    files = split_by_file(objs)
    if not files:
        raise PullError("the upstream tables held no cases")
    data_dir.mkdir(parents=True, exist_ok=True)
    staged = []
    try:
        for name, rows in files.items():
            fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=name + ".", suffix=".tmp")
            staged.append((tmp, data_dir / name, len(rows)))
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        for tmp, final, _ in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return [(final, n) for _, final, n in staged]
