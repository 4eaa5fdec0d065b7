"""Provenance: what produced a run, so that a comparison can say why two runs differ.

Contract
- `run_provenance(backend) -> dict[str, str]`: the fields that are the same for every case of
  a run, keyed by their trace field names (`traces/README.md`): ds4eval version, git
  commit of the checkout (with `+dirty` for uncommitted changes to tracked files; empty when not
  run from a checkout), extractor version, and what the backend reports through its public
  `provenance()` method (model file, chat template hash, BOS/EOS handling, device, KV cache
  type, endpoint URL, served model name, token counting rule); the model file becomes its
  SHA-256. For a server backend (one that reports an endpoint and no model file) the model
  file's SHA-256 comes from `model_file` (`--model-file GGUF`: the file the server was started
  with, for any server), else from the server's own `GET /v1/models` listing of the served
  model (`served_model_facts`: ds4-server's `meta.sha256`), which also gives the counting rule
  (`meta.completion_tokens_include_eos`). A server whose listing does not state the rule has it
  measured (`measure(endpoint, served_model, api_key)`, by default
  `countrule.measure_eos_counting`: two or three short greedy requests, asked once per process).
  A field nobody knows is "".
- `gen_tokens_eos`: whether a run's generated-token counts include the end-of-sequence token
  that ended a generation: "yes" (the engine and ds4-server count every sampled token), "no"
  (llama.cpp's servers count only the tokens of the text, as measured), "" when unknown.
- `file_sha256(path)`: SHA-256 of a file, cached by (absolute path, size, mtime) in
  `<cache dir>/file-sha256.json` (`$XDG_CACHE_HOME/ds4eval`, default `~/.cache/ds4eval`), so a
  second run costs one stat. The cache is rewritten atomically; a damaged or unwritable cache
  is ignored (the hash is computed again).
- `prompt_sha256(ids)` hashes a rendered prompt's token ids; `token_pieces(model, ids)` gives
  each id's text (through the model's incremental text stream, so the pieces concatenate to
  the decoded prompt). `RenderedPrompt` carries the hash, that text and where each token ends
  in it from a backend to the trace; `split_tokens(text, ends)` gives the pieces back.
- `extractor_version()`: a digest of the extraction and grading code (`cases.extract`,
  `cases.grade`; their syntax trees without docstrings or imports), so any change to how
  answers are read shows up without anyone remembering to bump a number, and moving or
  documenting the modules does not.
It does not decide anything: `compare` reads these fields.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ds4eval.atomicfile import write_text_atomic
from ds4eval.run import countrule

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
CACHE_FILE_NAME = "file-sha256.json"
# The run-level fields, in the order the trace writes them (TraceRecord has one field each).
RUN_FIELDS = ("model_sha256", "chat_template_sha256", "bos_eos", "device", "kv_type", "endpoint",
              "served_model", "gen_tokens_eos", "extractor_version", "ds4eval_version", "git_commit")
BACKEND_FIELDS = ("model_path", "chat_template_sha256", "bos_eos", "device", "kv_type", "endpoint",
                  "served_model", "gen_tokens_eos")
# How long the models listing may take: provenance must never hold a run up.
MODELS_TIMEOUT_S = 5.0


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4eval"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_sha256(ids: Iterable[int]) -> str:
    """SHA-256 of the ids written as decimal numbers joined by commas ("1,2,3")."""
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode("ascii")).hexdigest()


def _hash_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike, cache_file: str | os.PathLike | None = None) -> str:
    """The file's SHA-256 (hex), from the cache when path, size and mtime are unchanged."""
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cache_path = Path(cache_file) if cache_file is not None else cache_dir() / CACHE_FILE_NAME
    try:
        entries = json.loads(cache_path.read_text(encoding="utf-8")).get("files", {})
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError, AttributeError):
        entries = {}
    hit = entries.get(path)
    if isinstance(hit, dict) and all(hit.get(k) == v for k, v in stamp.items()) and hit.get("sha256"):
        return str(hit["sha256"])
    digest = _hash_file(path)
    entries[path] = {**stamp, "sha256": digest}
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache_path, json.dumps({"version": 1, "files": entries}, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only home still gets the hash, just not the cache
    return digest


@functools.lru_cache(maxsize=1)
def extractor_version() -> str:
    h = hashlib.sha256()
    for name in ("extract.py", "grade.py"):
        h.update(code_fingerprint((PACKAGE_ROOT / "cases" / name).read_text()).encode())
    return h.hexdigest()[:16]


def code_fingerprint(source: str) -> str:
    """The code of a module without its docstrings, comments, layout and import statements, so
    that moving a module or rewording its documentation keeps the version and changing what it
    computes changes it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))
                         and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                  and isinstance(s.value.value, str))] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def ds4eval_version() -> str:
    try:
        return importlib.metadata.version("ds4eval")
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=1)
def git_commit(root: str | None = None) -> str:
    """HEAD of the checkout ds4eval runs from ("<sha>+dirty" with uncommitted changes to
    tracked files); "" when it is not a git checkout or git is unavailable."""
    top = Path(root) if root else PACKAGE_ROOT.parent
    if not (top / ".git").exists():
        return ""
    try:
        head = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


@dataclass(frozen=True)
class RenderedPrompt:
    """The token ids a backend fed the model: their hash, their text, and the end offset of each
    token in that text (the trace's rendered_prompt and rendered_token_ends)."""

    sha256: str
    text: str
    ends: tuple[int, ...]

    @classmethod
    def of(cls, ids: list[int], pieces: Iterable[str]) -> "RenderedPrompt":
        pieces = list(pieces)
        ends, at = [], 0
        for p in pieces:
            at += len(p)
            ends.append(at)
        return cls(prompt_sha256(ids), "".join(pieces), tuple(ends))

    @property
    def ends_field(self) -> str:
        return ",".join(map(str, self.ends))


def split_tokens(text: str, ends: str) -> list[str]:
    """The token texts of a rendered prompt from its text and its comma-separated token ends."""
    out, start = [], 0
    for end in map(int, ends.split(",")) if ends else ():
        out.append(text[start:end])
        start = end
    return out


def token_pieces(model: Any, ids: list[int]) -> list[str]:
    """Each id's text through the model's incremental text stream (a multi-byte character cut
    across tokens appears on its last token); the pieces concatenate to the decoded prompt."""
    stream = model.text_stream()
    pieces = [stream.push(t) for t in ids]
    if pieces:
        pieces[-1] += stream.flush()
    return pieces


@dataclass(frozen=True)
class ServedFacts:
    """What a server's model listing says of the served model's file and usage."""
    model_sha256: str = ""
    gen_tokens_eos: str = ""


def served_model_facts(payload: Any, served_model: str) -> ServedFacts:
    """The facts a `GET /v1/models` answer gives about `served_model` (the only model listed when
    no listed id matches it): `meta.sha256` when it is 64 hex digits, and
    `meta.completion_tokens_include_eos` as "yes"/"no". Anything else gives nothing."""
    data = payload.get("data") if isinstance(payload, dict) else None
    cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
    named = [c for c in cards if c.get("id") == served_model]
    card = named[0] if named else cards[0] if len(cards) == 1 else None
    meta = card.get("meta") if card is not None else None
    if not isinstance(meta, dict):
        return ServedFacts()
    digest = meta.get("sha256")
    digest = digest.lower() if isinstance(digest, str) and len(digest) == 64 and \
        all(ch in "0123456789abcdefABCDEF" for ch in digest) else ""
    eos = meta.get("completion_tokens_include_eos")
    return ServedFacts(digest, {True: "yes", False: "no"}.get(eos, "") if isinstance(eos, bool) else "")


def fetch_models(endpoint: str, api_key: str | None) -> Any:
    """The JSON of the server's `GET /v1/models` (the server of `endpoint`); None when it cannot
    be had within `MODELS_TIMEOUT_S`."""
    import httpx

    from ds4eval.run.capabilities import api_root

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(api_root(endpoint) + "/v1/models", headers=headers, timeout=MODELS_TIMEOUT_S)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_provenance(backend: Any, file_hash=file_sha256, *, model_file: str | None = None,
                   api_key: str | None = None, fetch=fetch_models, measure=None) -> dict[str, str]:
    """The run-level provenance fields of a run through `backend` (see the module docstring);
    `fetch(endpoint, api_key)` reads a server's model listing and `measure(endpoint, model,
    api_key)` (default: `countrule.measure_eos_counting`, looked up at the call) finds the counting
    rule of a server that does not state it."""
    reported = backend.provenance() if hasattr(backend, "provenance") else {}
    unknown = set(reported) - set(BACKEND_FIELDS)
    if unknown:
        raise ValueError(f"backend provenance has unknown field(s): {', '.join(sorted(unknown))}")
    out = {k: "" for k in RUN_FIELDS}
    out.update({k: str(v) for k, v in reported.items() if k != "model_path" and v is not None})
    path = reported.get("model_path") or model_file
    if path and os.path.isfile(path):
        out["model_sha256"] = file_hash(path)
    if out["endpoint"] and not reported.get("model_path"):
        facts = served_model_facts(fetch(out["endpoint"], api_key), out["served_model"])
        out["model_sha256"] = out["model_sha256"] or facts.model_sha256
        out["gen_tokens_eos"] = out["gen_tokens_eos"] or facts.gen_tokens_eos
        if not out["gen_tokens_eos"]:
            # Several endpoints of one run serve one model (the probe checks it): the first stands for all.
            measure = measure or countrule.measure_eos_counting
            out["gen_tokens_eos"] = measure(out["endpoint"].split()[0], out["served_model"], api_key)
    out["extractor_version"] = extractor_version()
    out["ds4eval_version"] = ds4eval_version()
    out["git_commit"] = git_commit()
    return out
