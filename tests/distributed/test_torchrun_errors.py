"""Bad input under torchrun: one ``error:`` line for the whole job, the message in torchrun's error files, no
traceback from our code; the ranks exit with 2 and torchrun with 1."""

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from leangrpo_mcore.cli.common import run_main
from leangrpo_mcore.engine.launch import first_to_report
from leangrpo_mcore.errors import UserError
from tests.distributed.launcher import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")


def _torchrun(tmp_path, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "leangrpo_mcore.train", "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_bad_input_is_one_line_for_the_whole_job(tmp_path):
    # Both ranks fail at once. (An error found with the process group up goes the same way; a launch that gets
    # that far costs twenty seconds more on a small machine.)
    message = "command line: 'optim.lr' must be float, got str 'abc'"
    done = _torchrun(tmp_path, "optim.lr=abc")
    output = done.stderr + done.stdout
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], output
    assert not re.search(r'File ".*leangrpo_mcore', output), output  # torchrun's own traceback only
    assert done.returncode == 1, output  # torchrun's exit code for a failed worker
    # torchrun's summary: the ranks' exit code 2 and, instead of "To enable traceback see ...", the message.
    summary = output.split("Failures:")[1]
    assert re.search(r"exitcode\s*: 2 ", summary), summary
    assert re.search(r"traceback : " + re.escape(message), summary.split("Root Cause")[1]), summary
    assert "To enable traceback see" not in summary


def test_the_first_rank_to_fail_reports(monkeypatch):
    # The launcher's store: the first caller reports, the others do not (no process group involved).
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "1")
    assert first_to_report() is True
    monkeypatch.setenv("RANK", "0")
    assert first_to_report() is False
    del server
    # Without torchrun's store, rank 0 reports.
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert first_to_report() is True
    monkeypatch.setenv("RANK", "1")
    assert first_to_report() is False


def test_a_silent_rank_still_writes_its_error_file(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    def bad(argv):
        raise UserError("a bad value\nsecond line")

    assert run_main(bad, []) == 2
    assert capsys.readouterr().err == ""
    record = json.loads(error_file.read_text())
    assert record["message"]["message"] == "a bad value" and "py_callstack" not in record["message"]["extraInfo"]
