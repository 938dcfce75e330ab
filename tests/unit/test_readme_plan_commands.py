"""Every ``leangrpo-plan`` command of the README runs as written (read from the README, continuation lines
joined): exit 0, a plan on stdout, and with ``--simulate`` the simulated peaks next to the predicted ones."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_plan_commands(text: str) -> list[str]:
    """The ``leangrpo-plan`` command lines of the README's shell code blocks, each with its ``\\`` continuation
    lines joined."""
    commands, in_shell, current = [], False, None
    for line in text.splitlines():
        if line.startswith("```"):
            in_shell = not in_shell and line.strip() in ("```bash", "```sh", "```shell")
            continue
        if not in_shell:
            continue
        stripped = line.strip()
        if current is None and stripped.startswith("leangrpo-plan "):
            current = ""
        if current is None:
            continue
        current += " " + stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            commands.append(current.strip())
            current = None
    return commands


def test_the_reader_joins_continuations_and_skips_other_blocks():
    text = ("```bash\n# comment\nleangrpo-plan --a 1 \\\n    --b 2\nleangrpo-train x\nleangrpo-plan --c\n```\n"
            "```text\nleangrpo-plan --not-a-command\n```\n")
    assert readme_plan_commands(text) == ["leangrpo-plan --a 1 --b 2", "leangrpo-plan --c"]


COMMANDS = readme_plan_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_has_plan_commands():
    assert COMMANDS and any("--simulate" in c for c in COMMANDS) and any("--json" in c for c in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[f"line{i}" for i in range(len(COMMANDS))])
def test_readme_plan_command_runs_as_written(command):
    argv = shlex.split(command)
    # the installed entry point when there is one (the README's own words), else the same module
    entry = shutil.which(argv[0])
    argv = [entry] + argv[1:] if entry else [sys.executable, "-m", "leangrpo_mcore.cli.plan"] + argv[1:]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    if "--json" in argv:
        out = json.loads(proc.stdout)
        assert out["schedule"] and out["chosen"]["fits"] and out["chosen"]["parameters"]["total"] > 1e8
        simulated = [c for c in out["candidates"] if "simulated_peak_bytes" in c]
    else:
        assert "schedule: " in proc.stdout and "run it with: " in proc.stdout
        simulated = [line for line in proc.stdout.split("simulated (", 1)[-1].splitlines()[2:] if line.strip()] \
            if "simulated (" in proc.stdout else []
    if "--simulate" in argv:
        assert len(simulated) == (3 if "all" in argv else 1), proc.stdout[-2000:]
