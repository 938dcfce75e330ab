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


def _quickstart_test_command() -> str:
    """The second command of the README's Quickstart code block: the one ``.ci/run`` runs."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    commands = [line for line in block.splitlines()[1:] if line.strip() and not line.lstrip().startswith("#")]
    return commands[1]


def test_quickstart_installs_the_extras_the_cpu_tests_use():
    import ast

    command = _quickstart_test_command()
    match = re.search(r'-e "\.\[([\w,-]+)\]"', command)
    assert match and "pytest" in command, command
    installed = set(match.group(1).split(","))
    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    extras = next(ast.literal_eval(kw.value) for node in ast.walk(setup) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    assert installed <= set(extras), f"the Quickstart installs extras setup.py lacks: {installed - set(extras)}"
    # A test that skips when an extra is missing must run in CI: its extra is installed there.
    skipped_on = {m.group(1) for p in (ROOT / "tests").rglob("*.py")
                  for m in re.finditer(r"the '(\w+)' extra\) (?:is|are) not installed", p.read_text(encoding="utf-8"))}
    assert skipped_on and skipped_on <= installed, f"CI would skip the tests of {skipped_on - installed}"
