"""The repository speaks for itself: its docs point only at files a user has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".ini", ".toml", ".json"}
# Built from pieces so that this file does not match itself.
FOREIGN_DOC = re.compile("ALGO" + "RITHMS" + r"\.md")
TRACKER_REF = re.compile(r"\b[Ii]ssue[s]?\s*#?\d+|\bsee #\d+")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    names = out.stdout.split() if out.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    return [ROOT / n for n in names if (ROOT / n).suffix in TEXT_SUFFIXES and (ROOT / n).is_file()]


def test_no_reference_to_documents_outside_the_repo():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _tracked_files()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if FOREIGN_DOC.search(line)]
    assert not hits, f"references to a document users do not have: {hits[:5]}"


def test_no_issue_numbers():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in _tracked_files()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if TRACKER_REF.search(line)]
    assert not hits, f"issue-tracker references: {hits[:5]}"


def test_docstring_references_point_at_existing_docs():
    pattern = re.compile(r"docs/([\w./-]+\.md)")
    missing = sorted({m.group(1) for p in _tracked_files() for m in pattern.finditer(p.read_text(errors="replace"))
                      if not (ROOT / "docs" / m.group(1)).is_file()})
    assert not missing, f"docs pages referenced but absent: {missing}"
