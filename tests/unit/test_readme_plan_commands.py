"""Every ``leangrpo-plan`` command of the README runs as written (read from the README as a reader copies it, by
``tests/doc_commands.py``): exit 0, a plan whose chosen candidate fits, its parameters counted, and with
``--simulate`` the simulated peaks next to the predicted ones. (The generic documented-commands test checks the
exit code of every command; this one checks what a plan command promises.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_commands import commands_of, program_words

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [c.text for c in commands_of((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
            if program_words(c.text)[:1] == ["leangrpo-plan"]]


def test_the_readme_has_a_plan_command():
    assert COMMANDS


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[f"plan{i}" for i in range(len(COMMANDS))])
def test_readme_plan_command_runs_as_written(command):
    argv = program_words(command)
    entry = shutil.which(argv[0])  # the installed entry point (the README's own words), else the same module
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
        table = proc.stdout.split("simulated (", 1)[1].splitlines()[2:] if "simulated (" in proc.stdout else []
        simulated = [line for line in table if line.strip()]
    if "--simulate" in argv:
        assert len(simulated) == (3 if "all" in argv else 1), proc.stdout[-2000:]
