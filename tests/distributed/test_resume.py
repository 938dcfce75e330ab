"""Resume after ``kill -9`` equals the uninterrupted run bit for bit: weights, optimizer, EMA, metrics, samples.

The interrupted run is a separate process killed with SIGKILL as soon as it has logged step 3 (its last complete
checkpoint is then step 2, or step 4 if the kill landed late); the reference and the resumed runs run here.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.throughput import TIMED_SCALARS
from tests.ckpt_helpers import model_tensors, stored_tensors

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
ARGS = ("train.max_steps=6", "checkpoint.save_every=2", "train.ema_decay=0.9", "logging.sample_every=3")
NONDETERMINISTIC = ("time_", "peak_memory", "max_rss", *TIMED_SCALARS)


def _train_here(run: Path, *overrides: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", *ARGS, *overrides]) == 0
    finally:
        torch.set_num_threads(threads)


def _kill_after_step(run: Path, step: int) -> int:
    cmd = [sys.executable, "-m", "leangrpo_mcore.train", "--config", TINY_FLUX, f"train.output_dir={run}", *ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().count("\n") >= step:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
    return proc.wait(timeout=60)


def _deterministic(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)} for row in rows]


def _same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], dict):
            _same_tensors(a[name], b[name])
        elif isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name


def test_resume_after_kill_is_bit_identical(tmp_path):
    run, ref = tmp_path / "killed", tmp_path / "reference"
    assert _kill_after_step(run, 3) == -signal.SIGKILL
    complete = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMPLETE").is_file())
    assert complete and "step_6" not in complete  # killed mid-run, after at least one checkpoint
    os.makedirs(run / "checkpoints" / "step_8.tmp-crashed")  # a save that died half-way: never resumed
    _train_here(run, "checkpoint.resume=auto")
    assert not (run / "checkpoints" / "step_8.tmp-crashed").exists()
    _train_here(ref)

    assert _deterministic(run) == _deterministic(ref)
    assert [row["step"] for row in _deterministic(run)] == [1, 2, 3, 4, 5, 6]
    mine, theirs = run / "checkpoints" / "step_6", ref / "checkpoints" / "step_6"
    _same_tensors(model_tensors(mine), model_tensors(theirs))
    for prefix in ("ema/", "optim/"):
        _same_tensors(stored_tensors(mine, prefix), stored_tensors(theirs, prefix))
    records = [json.loads((path / "optimizer.json").read_text()) for path in (mine, theirs)]
    assert records[0] == records[1]
    assert (run / "samples" / "step_6.png").read_bytes() == (ref / "samples" / "step_6.png").read_bytes()


def test_resume_at_the_last_step_does_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    _train_here(run, "train.max_steps=2", "train.ema_decay=0")
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    _train_here(run, "train.max_steps=2", "train.ema_decay=0", "checkpoint.resume=auto")
    assert "finished 2 / 2 steps" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before
