"""Cases, suites, manifests and --validate-cases."""

import json
import shutil
from pathlib import Path

import pytest

from ds4eval.cases import answerkinds
from ds4eval.cases import case as cs
from ds4eval.cases import manifest
from ds4eval.cases.suites import DataMissing, load_suite

GOOD = {"source": "S", "id": "1", "domain": "d", "title": "t", "question": "q?", "choices": ["x", "y"],
        "answer": "B", "aliases": [], "answer_kind": "choice", "suites": ["core"]}


def test_parse_case_roundtrip_and_hash_is_content_only():
    c = cs.parse_case(GOOD)
    assert c.nchoices == 2 and c.key == ("S", "1")
    assert cs.parse_case(c.to_json()) == c
    moved = cs.parse_case({**GOOD, "suites": ["hard"]})
    assert cs.case_hash(moved) == cs.case_hash(c)  # membership is pinned by the manifest, not the hash
    assert cs.case_hash(cs.parse_case({**GOOD, "question": "q? "})) != cs.case_hash(c)
    assert cs.case_hash(c).startswith("sha256:") and len(cs.case_hash(c)) == 71


@pytest.mark.parametrize("patch, msg", [
    ({"answer": "C"}, "not a letter"),
    ({"answer_kind": "essay"}, "answer_kind"),
    ({"choices": ["only"]}, "2..10"),
    ({"id": ""}, "'id'"),
    ({"extra": 1}, "unknown field"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"answer_kind": "integer", "choices": [], "answer": "x1"}, "integer"),
    ({"answer_kind": "line_set", "choices": [], "answer": "9-3"}, "reversed"),
    ({"answer_kind": "rational", "choices": [], "answer": "1/0"}, "zero"),
    ({"suites": ["core", "core"]}, "twice"),
])
def test_malformed_cases_are_rejected(patch, msg):
    with pytest.raises(cs.CaseError, match=msg):
        cs.parse_case({**GOOD, **patch})


def test_parse_cases_collects_problems_with_line_numbers():
    text = json.dumps(GOOD) + "\n\n{not json\n" + json.dumps({**GOOD, "answer": "Z"}) + "\n" + json.dumps(GOOD)
    parsed = cs.parse_cases(text)
    assert len(parsed.cases) == 1
    assert [n for n, _ in parsed.problems] == [3, 4, 5]
    assert "duplicate" in parsed.problems[2][1]


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4EVAL_DATA", str(tmp_path / "env"))
    assert cs.resolve_data_dir(tmp_path / "x") == tmp_path / "x"
    assert cs.resolve_data_dir() == tmp_path / "env"
    monkeypatch.delenv("DS4EVAL_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert cs.resolve_data_dir() == tmp_path / "xdg" / "ds4eval" / "data"


def test_sanity_suite_covers_every_kind_and_grades_its_own_answers():
    from ds4eval.cases import grade

    sanity = load_suite("sanity", Path("/nonexistent"))
    assert 35 <= len(sanity) <= 45
    assert {c.answer_kind for c in sanity} == set(answerkinds.NAMES)
    for c in sanity:
        assert grade.grade_output(c.answer_kind, c.answer, f"Answer: {c.answer}", c.aliases, c.nchoices).passed, c.id


def test_suites_from_data(data_dir):
    core = load_suite("core", data_dir)
    hard = load_suite("hard", data_dir)
    smoke = load_suite("hard-smoke", data_dir)
    assert len(core) == 92 and len(hard) == 50 and len(smoke) == 12
    assert {c.source for c in core} == {"GPQA Diamond", "SuperGPQA", "AIME2025", "COMPSEC"}
    assert all(c.key in {h.key for h in hard} for c in smoke)
    assert len(cs.select_cases(hard, sources=["nist juliet"])) == 5
    assert [c.id for c in cs.select_cases(core, ids=[core[3].id])] == [core[3].id]


def test_manifests_hold_no_case_text(data_dir):
    """The committed manifests must not contain any question, choice or answer text."""
    texts = set()
    for f in ("core.jsonl", "hard.jsonl"):
        for c in cs.load_file(data_dir / f).cases:
            texts.add(c.question)
            texts.update(ch for ch in c.choices if len(ch) > 12)
    for suite in ("core", "hard"):
        raw = manifest.manifest_path(suite).read_text(encoding="utf-8")
        assert not [t for t in texts if t in raw]
        m = json.loads(raw)
        assert set(m["cases"][0]) == {"source", "id", "suites", "hash"}
        assert all(s["url"] and s["licence"] for s in m["sources"])


def test_manifests_are_up_to_date(data_dir):
    for suite in manifest.MANIFEST_SUITES:
        parsed = cs.load_file(data_dir / cs.SUITE_DATA_FILE[suite])
        built = manifest.format_manifest(manifest.build_manifest(suite, parsed.cases))
        assert built == manifest.manifest_path(suite).read_text(encoding="utf-8")


def test_validate_reports_missing_extra_altered_and_malformed(data_dir, tmp_path):
    assert manifest.validate_all(data_dir).ok
    shutil.copy(data_dir / "hard.jsonl", tmp_path / "hard.jsonl")
    lines = (data_dir / "core.jsonl").read_text(encoding="utf-8").splitlines()
    dropped = json.loads(lines[0])
    altered = json.loads(lines[1])
    altered["answer"] = "A" if altered["answer"] != "A" else "B"
    extra = {**json.loads(lines[2]), "id": "not-in-manifest"}
    new = [json.dumps(altered)] + lines[2:] + [json.dumps(extra), '{"source": "x"}']
    (tmp_path / "core.jsonl").write_text("\n".join(new) + "\n", encoding="utf-8")
    rep = manifest.validate_all(tmp_path)
    core = next(c for c in rep.checks if c.suite == "core")
    assert core.missing == [f"{dropped['source']}/{dropped['id']}"]
    assert core.altered == [f"{altered['source']}/{altered['id']}"]
    assert core.extra == [f"{extra['source']}/not-in-manifest"]
    assert len(core.malformed) == 1 and "line" in core.malformed[0]
    assert not rep.ok and next(c for c in rep.checks if c.suite == "hard").ok
    with pytest.raises(cs.CaseError, match="core.jsonl:93"):
        load_suite("core", tmp_path)


def test_load_suite_refuses_data_that_differs_from_the_pins(data_dir, tmp_path):
    lines = (data_dir / "hard.jsonl").read_text(encoding="utf-8").splitlines()
    obj = json.loads(lines[0])
    obj["title"] = obj["title"] + " (edited)"
    (tmp_path / "hard.jsonl").write_text("\n".join([json.dumps(obj)] + lines[1:]) + "\n", encoding="utf-8")
    with pytest.raises(cs.CaseError, match="1 altered"):
        load_suite("hard-smoke", tmp_path)


def test_missing_data_file_is_reported(tmp_path):
    with pytest.raises(DataMissing, match="--data-dir"):
        load_suite("core", tmp_path)
    rep = manifest.validate_all(tmp_path)
    assert not rep.ok and any("not found" in line for line in rep.lines())
