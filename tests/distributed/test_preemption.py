"""Preemption and stalls at world size 2 under torchrun.

SIGTERM to torchrun mid-run: the agent forwards it, both ranks finish the step in flight, save it and stop; the
resumed run equals the uninterrupted one bit for bit. A rank whose reward never returns: the step watchdog
names that rank and phase in one line and the job ends in seconds, not at the 30-minute collective timeout.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ckpt_helpers import model_tensors, stored_tensors
from tests.distributed.launcher import free_port, train_ranks
from tests.distributed.test_resume import _deterministic, _same_tensors

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
ARGS = ("train.max_steps=4", "checkpoint.save_every=0", "train.ema_decay=0.9", "logging.tensorboard=false")


def _torchrun(run: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "leangrpo_mcore.train",
           "--config", TINY_FLUX, f"train.output_dir={run}", *ARGS, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


def _signal_after_first_step(proc: subprocess.Popen, run: Path) -> None:
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= 1:
            proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.02)
    raise AssertionError("the run ended or stalled before its first step")


def test_sigterm_under_torchrun_saves_the_step_in_flight_and_resumes_bitwise(tmp_path):
    run, ref, marker = tmp_path / "preempted", tmp_path / "reference", tmp_path / "preempted.json"
    proc = _torchrun(run, env={"LEANGRPO_PREEMPTED_MARKER": str(marker)})
    _signal_after_first_step(proc, run)
    code, output = _finish(proc)
    assert code != 0, output  # torchrun itself ends with its SignalException
    record = json.loads(marker.read_text())
    step = record["step"]
    assert 1 <= step < 4 and record["signal"] == "SIGTERM" and record["exit_code"] == 143, record
    assert f"SIGTERM: stopped after step {step} with checkpoint" in output and "exit code 143" in output, output
    # The only checkpoint is the preemption's (save_every=0 saves at the end only), of the last logged step.
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == [f"step_{step}"] and (run / "checkpoints" / f"step_{step}" / "COMPLETE").is_file()
    assert [row["step"] for row in _deterministic(run)] == list(range(1, step + 1))

    code, output = _finish(_torchrun(run, "checkpoint.resume=auto"))
    assert code == 0 and f"resumed from {run / 'checkpoints' / f'step_{step}'}" in output, output
    train_ranks("--config", TINY_FLUX, f"train.output_dir={ref}", *ARGS)
    assert _deterministic(run) == _deterministic(ref)
    mine, theirs = run / "checkpoints" / "step_4", ref / "checkpoints" / "step_4"
    _same_tensors(model_tensors(mine), model_tensors(theirs))
    for prefix in ("ema/", "optim/"):
        _same_tensors(stored_tensors(mine, prefix), stored_tensors(theirs, prefix))


def stall_on_rank_1(images, prompts):
    """A reward that never returns on rank 1 (a hung remote call) and scores brightness elsewhere."""
    if os.environ.get("RANK") == "1":
        time.sleep(600)
    return images.float().mean(dim=(1, 2, 3))


def test_a_stalled_rank_is_named_in_one_line_by_the_watchdog(tmp_path):
    start = time.monotonic()
    proc = _torchrun(tmp_path / "run", f"reward.name={__name__}:stall_on_rank_1", "train.step_timeout_minutes=0.25")
    code, output = _finish(proc, timeout=180)
    elapsed = time.monotonic() - start
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert errors[0].startswith("error: step watchdog: rank 1 stalled in reward of step 1 ("), errors[0]
    assert "train.step_timeout_minutes=0.25); stopping the job" in errors[0]
    assert code == 1 and re.search(r"exitcode\s*: 124 ", output), output  # torchrun's summary of the ranks
    assert elapsed < 150, elapsed  # the timeout is 15 s; torchrun's start-up is the rest


def stall_on_rank_1_noting_when(images, prompts):
    """:func:`stall_on_rank_1`, writing the monotonic time the stall began to ``$STALL_BEGAN`` first."""
    if os.environ.get("RANK") == "1":
        Path(os.environ["STALL_BEGAN"]).write_text(repr(time.monotonic()))
    return stall_on_rank_1(images, prompts)


def test_a_stalled_rank_exits_on_torchruns_sigterm_within_seconds(tmp_path):
    """No step watchdog: rank 0's collective times out (parallel.timeout_minutes=0.1, 6 s) and torchrun signals
    rank 1 with SIGTERM, which its preemption handler would keep for a save it can never reach. Rank 1 has been in
    its phase longer than the collective timeout, so it exits at once: the job ends seconds after the timeout, not
    after torchrun's shutdown timeout (100 s here) and a SIGKILL."""
    began = tmp_path / "stall_began"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--shutdown-timeout", "100",
           "-m", "leangrpo_mcore.train", "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", *ARGS,
           f"reward.name={__name__}:stall_on_rank_1_noting_when", "parallel.timeout_minutes=0.1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                 "STALL_BEGAN": str(began)})
    code, output = _finish(proc, timeout=300)
    ended = time.monotonic()
    stalled_for = ended - float(began.read_text())
    assert re.search(r"SIGTERM reached rank 1 stalled in rollout and update of step 1 for \d+ s, longer than "
                     r"parallel\.timeout_minutes=0\.1: its peers have given up on it", output), output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "parallel.timeout_minutes=0.1" in errors[0], output  # rank 0's timeout line
    assert code == 1 and re.search(r"exitcode\s*: 143 ", output), output  # rank 1 exited itself, not SIGKILLed
    assert stalled_for < 50, (stalled_for, output[-3000:])  # 6 s of timeout, then seconds; 100+ s when ignored
