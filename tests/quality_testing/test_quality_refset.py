"""Tests for quality_testing.refset and the committed reference set (no model weights needed)."""
from __future__ import annotations

import numpy as np
import pytest

from quality_testing import longtext
from quality_testing import refset as rs

MAX_REFERENCE_BYTES = 4_000_000  # the committed references must stay small


@pytest.fixture(scope="module")
def manifest():
    return rs.parse_manifest(rs.MANIFEST.read_text(encoding="utf-8"))


def test_committed_manifest_round_trips(manifest):
    assert rs.parse_manifest(rs.format_manifest(manifest)) == manifest
    assert rs.format_manifest(manifest) == rs.MANIFEST.read_text(encoding="utf-8")


def test_committed_set_covers_every_kind_and_long_context(manifest):
    assert {c.kind for c in manifest} == set(rs.KINDS)
    longs = sorted(c.n_tokens for c in manifest if c.kind == "long")
    assert len(longs) == 3
    assert 900 <= longs[0] <= 1200 and 2700 <= longs[1] <= 3300 and 6500 <= longs[2] <= 7500
    assert any(p.endswith(".json") for p in (c.prompt for c in manifest))  # chat-rendered prompts


def test_committed_set_is_complete_and_from_one_checkpoint(manifest):
    assert len({c.gguf_sha256 for c in manifest}) == 1 and len(manifest[0].gguf_sha256) == 64
    assert len({c.reference for c in manifest}) == 1 and manifest[0].reference.startswith("transformers-")
    total = 0
    for c in manifest:
        path = rs.REFERENCES / c.reference_file
        ref = rs.read_reference(path)
        rs.check_reference(c, ref, c.gguf_sha256)
        assert ref.logits.dtype == np.float16 and ref.logits.shape[0] == len(ref.positions)
        assert int(ref.positions[-1]) == c.n_tokens - 1  # every case checks its frontier
        assert np.isfinite(ref.logits.astype(np.float32)).all()
        total += path.stat().st_size
    assert total < MAX_REFERENCE_BYTES
    assert {p.name for p in rs.REFERENCES.glob("*.npz")} == {c.reference_file for c in manifest}


def test_long_prompts_are_the_generator_output(tmp_path):
    longtext.write_long_prompts(tmp_path)
    for name in longtext.LONG_PROMPTS:
        assert (tmp_path / name).read_text(encoding="utf-8") == (rs.PROMPTS / name).read_text(encoding="utf-8")


def test_long_prompts_share_their_opening_and_ask_about_early_entries():
    short, facts = longtext.logbook(5)
    longer, _ = longtext.logbook(9)
    assert longer.startswith(short)
    q = longtext.long_prompt(9, 2)
    assert f"bed {facts[1]['bed']}" in q and q.endswith("the keeper")
    with pytest.raises(ValueError):
        longtext.long_prompt(3, 4)


def test_positions_resolve_from_both_ends():
    assert rs.resolve_positions("0,5,-1", 10) == [0, 5, 9]
    assert rs.resolve_positions("-1,9", 10) == [9]
    with pytest.raises(rs.RefSetError):
        rs.resolve_positions("10", 10)
    with pytest.raises(rs.RefSetError):
        rs.resolve_positions("a,1", 10)
    with pytest.raises(rs.RefSetError):
        rs.resolve_positions("", 10)


def _row(**kw):
    cells = dict(id="a", prompt="a.txt", kind="short", positions="-1", max_kl="0.1", min_top1="1",
                 max_abs_dlogit="2", max_dp_top="0.1", n_tokens="3", reference="r", gguf_sha256="s")
    cells.update(kw)
    return "\t".join(cells[c] for c in rs.COLUMNS)


@pytest.mark.parametrize("line, why", [
    (_row(kind="poem"), "kind"),
    (_row(id="A b"), "id"),
    (_row(prompt="../x.txt"), "prompt"),
    (_row(max_kl="lots"), "line"),
    (_row(positions="x"), "positions"),
    ("a\tb", "columns"),
])
def test_manifest_rejects_bad_rows(line, why):
    text = "\t".join(rs.COLUMNS) + "\n" + line + "\n"
    with pytest.raises(rs.RefSetError, match=why):
        rs.parse_manifest(text)


def test_manifest_rejects_duplicates_and_bad_header():
    with pytest.raises(rs.RefSetError, match="duplicate"):
        rs.parse_manifest("\t".join(rs.COLUMNS) + "\n" + _row() + "\n" + _row() + "\n")
    with pytest.raises(rs.RefSetError, match="header"):
        rs.parse_manifest("id\tprompt\n")


def test_prompt_files_text_and_chat(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "b.json").write_text('[{"role": "user", "content": "hi"}]', encoding="utf-8")
    (tmp_path / "c.json").write_text('{"role": "user"}', encoding="utf-8")
    assert rs.read_prompt_file("a.txt", tmp_path) == "hello"  # one editor newline dropped
    msgs = rs.read_prompt_file("b.json", tmp_path)
    assert rs.prompt_text(msgs, lambda m: "<" + m[0]["content"] + ">") == "<hi>"
    with pytest.raises(rs.RefSetError):
        rs.read_prompt_file("c.json", tmp_path)
    with pytest.raises(rs.RefSetError):
        rs.read_prompt_file("missing.txt", tmp_path)


def test_reference_round_trip_and_refusal_of_another_checkpoint(tmp_path):
    ref = rs.Reference(ids=np.arange(6, dtype=np.int32), positions=np.array([2, 5], dtype=np.int32),
                       logits=np.random.default_rng(0).normal(size=(2, 50)).astype(np.float16),
                       gguf_sha256="a" * 64, reference="test-1.0/float32", prompt_sha256="p")
    path = tmp_path / "x.npz"
    rs.write_reference(path, ref)
    back = rs.read_reference(path)
    assert np.array_equal(back.logits, ref.logits) and back.positions.tolist() == [2, 5]
    assert back.reference == "test-1.0/float32" and not list(tmp_path.glob("*.tmp*"))
    case = rs.parse_manifest("\t".join(rs.COLUMNS) + "\n" + _row(id="x", positions="2,-1", n_tokens="6",
                                                                 gguf_sha256="a" * 64) + "\n")[0]
    rs.check_reference(case, back, "a" * 64)
    with pytest.raises(rs.RefSetError, match="another GGUF|made from GGUF"):
        rs.check_reference(case, back, "b" * 64)
    moved = rs.with_render(case, positions="1,-1")
    with pytest.raises(rs.RefSetError, match="positions"):
        rs.check_reference(moved, back, "a" * 64)
    with pytest.raises(rs.RefSetError, match="missing"):
        rs.read_reference(tmp_path / "none.npz")
