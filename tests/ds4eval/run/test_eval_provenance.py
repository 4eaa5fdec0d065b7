"""Provenance: the cached model hash, the run's fields, and their place in traces and summaries."""

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from ds4eval.cases.case import case_hash, parse_case
from ds4eval.config import EvalConfig
from ds4eval.run import provenance as pv
from ds4eval.run import trace as tr
from ds4eval.run.backends.engine_backend import EngineBackend
from ds4eval.run.backends.openai_backend import OpenAIBackend
from ds4eval.run.runner import Runner

from engine_fakes import FAKE_ENGINE, FakeModel

REPO = Path(__file__).resolve().parents[3]


def test_file_hash_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"weights" * 1000)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert pv.file_sha256(f) == want
    cache = tmp_path / "cache" / "ds4eval" / pv.CACHE_FILE_NAME
    entry = json.loads(cache.read_text())["files"][str(f)]
    assert entry == {"size": 7000, "mtime_ns": f.stat().st_mtime_ns, "sha256": want}
    assert os.listdir(cache.parent) == [pv.CACHE_FILE_NAME]  # written atomically: no temporary left behind

    def no_reading(path, chunk=0):
        raise AssertionError("the cached hash should have been used")

    monkeypatch.setattr(pv, "_hash_file", no_reading)
    assert pv.file_sha256(f) == want  # second run: one stat, no read
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f.write_bytes(b"other weights")  # new size and mtime: hashed again
    assert pv.file_sha256(f) == hashlib.sha256(b"other weights").hexdigest()
    cache.write_text("{not json")  # a damaged cache is ignored and replaced
    assert pv.file_sha256(f) == hashlib.sha256(b"other weights").hexdigest()
    assert json.loads(cache.read_text())["version"] == 1


def test_file_hash_without_a_writable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    assert pv.file_sha256(f) == hashlib.sha256(b"abc").hexdigest()


def test_prompt_hash_pieces_and_versions():
    assert pv.prompt_sha256([1, 2, 3]) == hashlib.sha256(b"1,2,3").hexdigest()
    assert pv.prompt_sha256([1, 2, 3]) != pv.prompt_sha256([1, 23])
    model = FakeModel()
    ids = model.tokenize("<|im_start|>héllo ✓", special=True)
    pieces = pv.token_pieces(model, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == model.detokenize(ids)
    assert pieces[0] == "<|im_start|>" and "" in pieces  # a cut multi-byte character shows on its last byte
    code = [pv.code_fingerprint((REPO / "ds4eval" / "cases" / f).read_text()) for f in ("extract.py", "grade.py")]
    assert pv.extractor_version() == hashlib.sha256("".join(code).encode()).hexdigest()[:16]
    assert pv.ds4eval_version()


def test_extractor_version_follows_the_code_not_its_documentation_or_place():
    code = '"""Doc."""\nfrom ds4eval.cases import answerkinds\n\ndef f(x):\n    """Say."""\n    return x + 1  # one\n'
    moved = '"""Other doc."""\nimport os\nfrom ds4eval import answerkinds\n\n\ndef f(x):\n    return x + 1\n'
    assert pv.code_fingerprint(code) == pv.code_fingerprint(moved)
    assert pv.code_fingerprint(code) != pv.code_fingerprint(code.replace("x + 1", "x + 2"))
    assert pv.code_fingerprint(code) != pv.code_fingerprint(code.replace("def f", "def g"))


def test_git_commit_of_a_checkout_and_of_anything_else(tmp_path):
    assert pv.git_commit.__wrapped__(str(tmp_path)) == ""
    if (REPO / ".git").exists():
        commit = pv.git_commit.__wrapped__(str(REPO))
        assert len(commit.removesuffix("+dirty")) == 40


def test_backends_report_what_they_know(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = FakeModel()
    backend = EngineBackend(model, FAKE_ENGINE)
    assert backend.provenance()["bos_eos"] == "add_bos=no bos=259 eos=256"
    assert pv.run_provenance(backend)["model_sha256"] == ""  # /dev/null is no model file
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF...")
    model.path, model.metadata = str(gguf), {"tokenizer.chat_template": "{{ messages }}"}
    prov = pv.run_provenance(backend)
    assert prov["model_sha256"] == hashlib.sha256(b"GGUF...").hexdigest()
    assert prov["chat_template_sha256"] == hashlib.sha256(b"{{ messages }}").hexdigest()
    assert set(prov) == set(pv.RUN_FIELDS) <= {f.name for f in dataclasses.fields(tr.TraceRecord)}
    model.metadata = {}
    assert pv.run_provenance(backend)["chat_template_sha256"] == "none"
    server = OpenAIBackend(EvalConfig(backend="openai", urls=("http://127.0.0.1:9/v1",), served_model="qwen"))
    prov = pv.run_provenance(server)
    assert (prov["endpoint"], prov["served_model"], prov["model_sha256"]) == \
        ("http://127.0.0.1:9/v1/chat/completions", "qwen", "")
    server.close()


def test_every_trace_block_carries_provenance(tmp_path):
    cases = [parse_case({"source": "toy", "id": f"c{i}", "question": f"What is {i}?", "answer": "4",
                         "answer_kind": "integer", "max_tokens": 64 if i == 1 else None}) for i in (1, 2)]
    model = FakeModel()
    cfg = EvalConfig(trace=str(tmp_path / "t.trace"), tokens=100)
    Runner(cfg, cases, EngineBackend(model, FAKE_ENGINE)).run()
    records = tr.read_trace(cfg.trace).records
    assert [r.case_hash for r in records] == [case_hash(c) for c in cases]
    assert [r.max_tokens for r in records] == [64, 100]
    for r in records:
        ids = model.tokenize(r.rendered_prompt, special=True)
        assert r.prompt_sha256 == pv.prompt_sha256(ids) and len(ids) == r.prompt_tokens
        assert pv.split_tokens(r.rendered_prompt, r.rendered_token_ends) == pv.token_pieces(model, ids)
        assert r.rendered_prompt.startswith("<|im_start|>system\n") and r.question_prompt in r.rendered_prompt
        assert r.extractor_version == pv.extractor_version() and r.ds4eval_version == pv.ds4eval_version()
        assert r.bos_eos == "add_bos=no bos=259 eos=256" and r.model_sha256 == ""


def test_provenance_fields_round_trip_and_old_traces_still_load():
    pieces = ["<|im_start|>", "\n", "%%end", "say \"hi\"", "back\\slash", "\\n", "\r", "✓", "", "\\"]
    prompt = pv.RenderedPrompt.of([1, 2], pieces)
    rec = tr.TraceRecord(index=1, source="s", id="a", status="PASSED", case_hash="sha256:" + "0" * 64, max_tokens=7,
                         prompt_sha256="1" * 64, model_sha256="2" * 64, git_commit="3" * 40 + "+dirty",
                         endpoint="http://h/v1/chat/completions", rendered_prompt=prompt.text,
                         rendered_token_ends=prompt.ends_field, model_output="%%end\nok")
    text = tr.format_record(rec)
    assert text.count("\n%%end\n") == 1 and "\n%%%end\nok\n%%end\n" in text
    (back,) = tr.parse_trace(text).records
    assert back == rec and pv.split_tokens(back.rendered_prompt, back.rendered_token_ends) == pieces
    old = tr.read_trace(REPO / "traces" / "sanity-smollm2-greedy.trace")
    assert len(old.records) == 41 and not old.problems
    r = old.records[0]
    assert (r.case_hash, r.max_tokens, r.prompt_sha256, r.rendered_prompt, r.git_commit) == ("", 0, "", "", "")


@pytest.mark.parametrize("name", ["sanity-smollm2-greedy.trace", "sanity-arith-code-ds4server.trace"])
def test_committed_example_traces_parse(name):
    parsed = tr.read_trace(REPO / "traces" / name)
    assert parsed.records and not parsed.problems


# --- a server backend's model file --------------------------------------------------------

DIGEST = "ab" * 32


def models_listing(model_id: str, **meta) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "meta": meta}]}


@pytest.mark.parametrize("payload,served,facts", [
    (models_listing("smollm2", sha256=DIGEST, completion_tokens_include_eos=True), "smollm2",
     pv.ServedFacts(DIGEST, "yes")),
    # The only model listed stands for the served one whatever name the requests give.
    (models_listing("/models/x.gguf", sha256=DIGEST.upper()), "other", pv.ServedFacts(DIGEST, "")),
    (models_listing("m", sha256=None, completion_tokens_include_eos=False), "m", pv.ServedFacts("", "no")),
    (models_listing("m", sha256="not-a-digest", completion_tokens_include_eos="yes"), "m", pv.ServedFacts()),
    ({"data": [{"id": "a", "meta": {"sha256": DIGEST}}, {"id": "b"}]}, "c", pv.ServedFacts()),
    ({"object": "list", "data": [{"id": "m", "owned_by": "llamacpp"}]}, "m", pv.ServedFacts()),
    (None, "m", pv.ServedFacts()), ("<html>", "m", pv.ServedFacts()),
])
def test_served_model_facts_read_what_the_listing_says(payload, served, facts):
    assert pv.served_model_facts(payload, served) == facts


def test_a_server_backend_gets_its_model_file_from_the_flag_or_the_servers_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    server = OpenAIBackend(EvalConfig(backend="openai", urls=("http://127.0.0.1:9/v1",), served_model="qwen"))
    asked = []

    def fetch(endpoint, api_key):
        asked.append((endpoint, api_key))
        return models_listing("qwen", sha256=DIGEST, completion_tokens_include_eos=True)

    prov = pv.run_provenance(server, api_key="k", fetch=fetch)
    assert (prov["model_sha256"], prov["gen_tokens_eos"]) == (DIGEST, "yes")
    assert asked == [("http://127.0.0.1:9/v1/chat/completions", "k")]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF...")
    prov = pv.run_provenance(server, model_file=str(gguf), fetch=fetch)
    assert prov["model_sha256"] == hashlib.sha256(b"GGUF...").hexdigest() and prov["gen_tokens_eos"] == "yes"
    assert pv.run_provenance(server, fetch=lambda *_: None)["model_sha256"] == ""
    server.close()
    # The engine knows its own file and rule and asks no server.
    engine = EngineBackend(FakeModel(), FAKE_ENGINE)
    assert pv.run_provenance(engine, fetch=lambda *_: pytest.fail("asked a server"))["gen_tokens_eos"] == "yes"


def test_model_file_applies_to_a_server_and_must_exist(tmp_path):
    from ds4eval.config import ConfigError

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    EvalConfig(backend="openai", urls=("http://127.0.0.1:9",), model_file=str(gguf)).validate()
    with pytest.raises(ConfigError, match="--model-file .*: no such file"):
        EvalConfig(backend="openai", urls=("http://127.0.0.1:9",), model_file=str(tmp_path / "none.gguf")).validate()
    with pytest.raises(ConfigError, match="--model-file applies to the openai backend"):
        EvalConfig(model_file=str(gguf)).validate()


def test_ds4_servers_listing_gives_its_model_file_and_counting_rule(tmp_path):
    import time

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import ServerConfig

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    app = create_app(FakeModel(path=str(gguf)), ServerConfig(allowed_hosts=("testserver",)), engine=FAKE_ENGINE)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while (listing := client.get("/v1/models").json())["data"][0]["meta"]["sha256"] is None:
            assert time.monotonic() < deadline, "the server never listed its file's hash"
            time.sleep(0.02)
    backend = OpenAIBackend(EvalConfig(backend="openai", urls=("http://127.0.0.1:9",)))
    prov = pv.run_provenance(backend, fetch=lambda *_: listing)
    backend.close()
    assert prov["model_sha256"] == hashlib.sha256(b"GGUF fake weights").hexdigest()
    assert prov["gen_tokens_eos"] == "yes"
