"""Every command-line tool answers ``--version`` with the package version that setup.py installs."""

import subprocess
import sys
from pathlib import Path

import pytest

import leangrpo_mcore
from leangrpo_mcore.cli import bench, convert, plan, torchrun, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", [train, convert, plan, bench, torchrun])
def test_every_cli_prints_the_version(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"leangrpo_mcore {leangrpo_mcore.__version__}\n"


def test_setup_reads_the_package_version_without_importing_it():
    script = ("import runpy, sys; sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py'); "
              "print('imported' if 'leangrpo_mcore' in sys.modules else 'not imported')")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [leangrpo_mcore.__version__, "not imported"]
    assert leangrpo_mcore.__version__.count(".") == 2
