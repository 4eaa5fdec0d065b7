"""Suite manifests: pins of benchmark cases by source, id and content hash; validation of data.

Contract
- A manifest (`suites/<suite>/manifest.json`) lists, in run order, each case's source, id,
  suite membership and `case_hash`, plus the data file it is read from and the sources'
  URLs and licences. It never holds question text, choices or answers.
- `build_manifest(suite, cases)` makes one from parsed cases (pure);
  `python -m ds4eval.cases.manifest [--data-dir DIR]` regenerates `suites/core` and `suites/hard`
  from a data directory (atomic writes).
- `compare(manifest, parsed_file)` reports missing, extra and altered cases by id, plus
  malformed lines; `validate_all(data_dir)` does it for every suite and the committed sanity
  suite. `ValidationReport.ok` is what `ds4-eval validate` exits on.
It does not fetch data and never modifies the data directory.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from ds4eval.atomicfile import write_text_atomic
from ds4eval.cases import case as cs

MANIFEST_VERSION = 1

# Provenance of every benchmark source the manifests pin (URL and licence of the original).
SOURCES = {
    "GPQA Diamond": ("https://huggingface.co/datasets/Idavidrein/gpqa", "CC-BY-4.0"),
    "SuperGPQA": ("https://huggingface.co/datasets/m-a-p/SuperGPQA", "ODC-BY"),
    "AIME2025": ("https://huggingface.co/datasets/test-time-compute/aime_2025", "MIT"),
    "COMPSEC": ("https://github.com/antirez/ds4",
                "reduced functions derived from public CVE write-ups (ds4 project)"),
    "MMLU-Pro": ("https://github.com/TIGER-AI-Lab/MMLU-Pro", "Apache-2.0"),
    "OlympiadBench": ("https://huggingface.co/datasets/Hothan/OlympiadBench", "Apache-2.0"),
    "LiveBench": ("https://huggingface.co/datasets/livebench/reasoning", "Apache-2.0"),
    "NIST Juliet": ("https://samate.nist.gov/SARD/test-suites/112", "CC0-1.0"),
}

# Which curated table each manifested suite was converted from (see DATA.md of the data dir).
UPSTREAM = {
    "core": {"repository": "https://github.com/antirez/ds4", "revision": "8d57664", "file": "ds4_eval.c"},
    "hard": {"repository": "https://github.com/zzyu17/ds4", "revision": "93998b2",
             "file": "ds4_eval_cases.c"},
}

MANIFEST_SUITES = ("core", "hard")
# hard-smoke is a subset of hard: its members are the hard manifest entries marked with it.
SUBSET_OF = {"hard-smoke": "hard"}


def manifest_path(suite: str, suites_dir: Path = cs.SUITES_DIR) -> Path:
    return suites_dir / SUBSET_OF.get(suite, suite) / "manifest.json"


def build_manifest(suite: str, cases: list[cs.Case]) -> dict:
    """Manifest for `suite` from its cases (file order kept)."""
    members = [c for c in cases if suite in c.suites]
    sources = []
    for name in dict.fromkeys(c.source for c in members):
        url, licence = SOURCES.get(name, ("", "unknown"))
        sources.append({"name": name, "url": url, "licence": licence,
                        "cases": sum(c.source == name for c in members)})
    return {
        "version": MANIFEST_VERSION,
        "suite": suite,
        "data_file": cs.SUITE_DATA_FILE[suite],
        "upstream": UPSTREAM.get(suite, {}),
        "hash_algorithm": "sha256 over ds4eval.cases.case.canonical_content(case)",
        "sources": sources,
        "cases": [{"source": c.source, "id": c.id, "suites": list(c.suites), "hash": cs.case_hash(c)}
                  for c in members],
    }


def format_manifest(manifest: dict) -> str:
    """JSON text with one case per line, so that a changed pin is a one-line diff."""
    head = {k: v for k, v in manifest.items() if k != "cases"}
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]
    rows = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in manifest["cases"])
    return text + ',\n "cases": [\n' + rows + "\n ]\n}\n"


def load_manifest(suite: str, suites_dir: Path = cs.SUITES_DIR) -> dict:
    path = manifest_path(suite, suites_dir)
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: unsupported manifest version {data.get('version')!r}")
    return data


@dataclass
class SuiteCheck:
    suite: str
    path: str
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    altered: list[str] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    file_missing: bool = False
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.altered or self.malformed or self.file_missing)


def compare(manifest: dict, parsed: cs.ParsedFile) -> SuiteCheck:
    """Data cases of one file against one manifest (pure)."""
    suite = manifest["suite"]
    check = SuiteCheck(suite=suite, path=manifest["data_file"])
    check.malformed = [f"line {n}: {msg}" for n, msg in parsed.problems]
    pinned = {(e["source"], e["id"]): e for e in manifest["cases"]}
    present = {c.key: c for c in parsed.cases if suite in c.suites}
    for key, entry in pinned.items():
        case = present.get(key)
        if case is None:
            check.missing.append(_label(key))
        elif cs.case_hash(case) != entry["hash"] or sorted(case.suites) != sorted(entry["suites"]):
            check.altered.append(_label(key))
    check.extra = [_label(k) for k in present if k not in pinned]
    check.checked = len(present)
    return check


def _label(key: tuple[str, str]) -> str:
    return f"{key[0]}/{key[1]}"


@dataclass
class ValidationReport:
    checks: list[SuiteCheck]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def lines(self) -> list[str]:
        out = []
        for c in self.checks:
            if c.file_missing:
                out.append(f"{c.suite}: data file {c.path} not found")
                continue
            verdict = "ok" if c.ok else "FAILED"
            out.append(f"{c.suite}: {c.checked} cases checked against {c.path}: {verdict}")
            for what, items in (("missing", c.missing), ("extra", c.extra), ("altered", c.altered),
                                ("malformed", c.malformed)):
                out.extend(f"  {what}: {item}" for item in items)
        return out


def validate_all(data_dir: Path, suites_dir: Path = cs.SUITES_DIR) -> ValidationReport:
    """Check the committed sanity suite and every manifested suite against `data_dir`."""
    checks = []
    sanity_path = cs.COMMITTED_SUITE_FILE["sanity"]
    parsed = cs.load_file(sanity_path)
    sanity = SuiteCheck(suite="sanity", path=str(sanity_path), checked=len(parsed.cases))
    sanity.malformed = [f"line {n}: {msg}" for n, msg in parsed.problems]
    checks.append(sanity)
    for suite in MANIFEST_SUITES:
        manifest = load_manifest(suite, suites_dir)
        path = data_dir / manifest["data_file"]
        if not path.is_file():
            checks.append(SuiteCheck(suite=suite, path=str(path), file_missing=True))
            continue
        check = compare(manifest, cs.load_file(path))
        check.path = str(path)
        checks.append(check)
    return ValidationReport(checks)


def write_manifests(data_dir: Path, suites_dir: Path = cs.SUITES_DIR) -> list[Path]:
    """Regenerate the manifests of every manifested suite from the data files."""
    written = []
    for suite in MANIFEST_SUITES:
        path = data_dir / cs.SUITE_DATA_FILE[suite]
        parsed = cs.load_file(path)
        if parsed.problems:
            n, msg = parsed.problems[0]
            raise cs.CaseError(f"{path}:{n}: {msg}")
        manifest = build_manifest(suite, parsed.cases)
        out = manifest_path(suite, suites_dir)
        write_text_atomic(out, format_manifest(manifest))
        written.append(out)
    return written


@click.command()
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Data directory (default: $DS4EVAL_DATA, then the per-user default).")
def main(data_dir: str | None) -> None:
    """Regenerate suites/core/manifest.json and suites/hard/manifest.json from the data files."""
    try:
        for path in write_manifests(cs.resolve_data_dir(data_dir)):
            click.echo(f"wrote {path}")
    except (OSError, ValueError) as e:
        click.echo(f"ds4eval.cases.manifest: error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
