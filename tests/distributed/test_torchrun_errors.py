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


def _launch(tmp_path, *overrides):
    """The job through ``python -m leangrpo_mcore.launch`` (what ``leangrpo-torchrun`` runs)."""
    cmd = [sys.executable, "-m", "leangrpo_mcore.launch", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "leangrpo_mcore.train", "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def _assert_one_line_only(done, message):
    output = done.stderr + done.stdout
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output and "ChildFailedError" not in output and "Failures:" not in output, output
    assert "failed (exitcode" not in output, output
    assert done.returncode == 2, output  # the ranks' code, not torchrun's 1


def test_the_launcher_ends_bad_input_with_the_one_line(tmp_path):
    _assert_one_line_only(_launch(tmp_path, "optim.lr=abc"), "command line: 'optim.lr' must be float, got str 'abc'")


@pytest.mark.slow
def test_the_launcher_ends_a_bad_layout_with_the_one_line_naming_the_keys(tmp_path):
    # Found once the process group is up, after torchrun's rendezvous: the case plain torchrun ends in its traceback.
    _assert_one_line_only(_launch(tmp_path, "grpo.group_size=3"), "grpo.group_size=3, grpo.prompts_per_step=2")


def _failure(tmp_path, rank, exitcode, record, timestamp):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    if record is None:  # a rank the agent killed writes no error file
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(tmp_path / "none"))
    path = tmp_path / f"error_{len(list(tmp_path.iterdir()))}.json"
    record["message"]["extraInfo"]["timestamp"] = str(timestamp)
    path.write_text(json.dumps(record))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_which_failures_end_quietly(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from leangrpo_mcore.cli.torchrun import exit_code_of

    one_line = {"message": {"message": "a bad value", "extraInfo": {}}}
    crash = {"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "Traceback ..."}}}

    def code(*failures):
        return exit_code_of(ChildFailedError("leangrpo_mcore.train", {f.local_rank: f for f in failures}))

    def copy(record):
        return json.loads(json.dumps(record))

    # The first failure decides: a one-line rank (2, or 124 for a stall), then a rank the agent killed (no error
    # file: stamped "now", later).
    assert code(_failure(tmp_path, 0, 2, copy(one_line), 10), _failure(tmp_path, 1, -15, None, 0)) == 2
    assert code(_failure(tmp_path, 1, 124, copy(one_line), 10)) == 124
    assert code(_failure(tmp_path, 0, -15, None, 0), _failure(tmp_path, 1, 2, copy(one_line), 10)) == 2
    assert code(_failure(tmp_path, 0, 1, copy(crash), 10)) is None  # a traceback: torchrun's summary
    assert code(_failure(tmp_path, 0, 2, copy(crash), 10)) is None
    assert code(_failure(tmp_path, 0, 1, copy(one_line), 10)) is None  # not a one-line exit code
    assert code(_failure(tmp_path, 0, -9, None, 0)) is None  # killed: no error file
