"""One trainer per run directory, preemption saves and the step watchdog, on one process.

The lock cases fail before any model is built (well under a second each); the preemption cases run the tiny
FLUX config for one or two steps. The world-size-2 signal path under torchrun is in
tests/distributed/test_preemption.py.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.engine.control.lock import LOCK_NAME, RunLock, read_holder
from leangrpo_mcore.engine.control.preemption import exit_code
from leangrpo_mcore.engine.control.watchdog import EXIT_STEP_TIMEOUT, Phase, laggard

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
FAST = ("logging.tensorboard=false", "logging.progress_bar=false")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models gain nothing from more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(capsys, run: Path, *overrides: str) -> tuple[int, list[str], str]:
    code = main(["--config", TINY_FLUX, f"train.output_dir={run}", *FAST, *overrides])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    return code, errors, captured.err + captured.out


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_trainer_on_a_held_directory_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    with RunLock.acquire(str(run)):
        code, errors, output = _train(capsys, run, "checkpoint.resume=auto")
    assert code == 2 and len(errors) == 1, output
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in errors[0], errors[0]
    assert "is in use by another trainer" in errors[0] and "Traceback" not in output
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()  # refused before any write


def test_a_lock_held_by_another_process_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from leangrpo_mcore.engine.control.lock import RunLock
        lock = RunLock.acquire({str(run)!r})
        print("held", flush=True)
        time.sleep(60)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        code, errors, output = _train(capsys, run)
        assert code == 2 and len(errors) == 1, output
        assert f"pid {holder.pid} on host" in errors[0], errors[0]
    finally:
        holder.kill()
        holder.wait()
    # The kernel freed the lock with its holder; the text it left is stale and is taken over with a warning.
    warnings = []
    with RunLock.acquire(str(run), warn=warnings.append) as lock:
        assert read_holder(lock.path).pid == os.getpid()
    assert len(warnings) == 1 and f"pid {holder.pid}" in warnings[0] and "no longer running" in warnings[0]


def test_a_stale_lock_file_is_taken_over_with_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = _dead_pid()
    (run / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    warnings = []
    lock = RunLock.acquire(str(run), warn=warnings.append)
    assert warnings == [f"taking over the stale lock {run / LOCK_NAME} of pid {dead} on host "
                        f"{socket.gethostname()} (no longer running)"]
    assert read_holder(str(run / LOCK_NAME)).pid == os.getpid()
    lock.release()
    assert (run / LOCK_NAME).read_text() == ""  # a clean release leaves no holder behind
    again = []
    RunLock.acquire(str(run), warn=again.append).release()
    assert again == []


_SEND: list = []


def _signal_at_first_call(images, prompts):
    """A reward that sends this process its signal twice at its first call (a scheduler's signal and torchrun's
    forwarded copy), while step 1 is in flight."""
    if _SEND:
        signum = _SEND.pop()
        os.kill(os.getpid(), signum)
        os.kill(os.getpid(), signum)
    return -images.float().mean(dim=(1, 2, 3))


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_a_signal_mid_step_saves_that_step_and_exits_128_plus_its_number(tmp_path, capsys, signum, code):
    run = tmp_path / "run"
    _SEND[:] = [signum]
    status, errors, output = _train(capsys, run, "train.max_steps=3", "checkpoint.save_every=0",
                                    "checkpoint.async_save=true", f"reward.name={__name__}:_signal_at_first_call")
    assert status == exit_code(signum) == code, output
    name = signal.Signals(signum).name
    assert errors == [] and f"{name}: stopped after step 1 with checkpoint" in output, output
    assert (run / "checkpoints" / "step_1" / "COMPLETE").is_file()  # written synchronously despite async_save
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert signal.getsignal(signum) == signal.SIG_DFL  # the handlers are put back


def test_an_empty_save_on_signal_keeps_the_default_actions(tmp_path, capsys):
    code = r"""
import os, signal, sys
from leangrpo_mcore.cli.train import main
from tests.unit import test_preemption as t
t._SEND[:] = [signal.SIGUSR1]
sys.exit(main(["--config", t.TINY_FLUX, "train.output_dir=" + sys.argv[1], "train.max_steps=2",
               "train.save_on_signal=[]", "reward.name=tests.unit.test_preemption:_signal_at_first_call", *t.FAST]))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == -signal.SIGUSR1, done.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints" / "step_1").exists()


def test_the_slurm_example_requeues_on_preemption():
    script = (ROOT / "examples" / "train_slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    assert 'scontrol requeue "${SLURM_JOB_ID}"' in script and "LEANGRPO_PREEMPTED_MARKER" in script
    # torchrun's own parser accepts the flags that make it forward SIGUSR1 and wait for the save.
    from torch.distributed.run import get_args_parser

    flags = script.split("--signals-to-handle ")[1].split(" \\")[0].split()
    args = get_args_parser().parse_args(["--signals-to-handle", *flags[:1], *flags[1:], "train.py"])
    assert "SIGUSR1" in args.signals_to_handle.split(",") and args.shutdown_timeout == 110 < 120


_STUBS = {
    # srun: drop its own options, run the job step's command
    "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
    "scontrol": 'if [[ "$1" == show ]]; then echo node-0; else echo "scontrol $*" >> "$STUB_LOG"; fi',
    # the launcher: records its command line, then does what the case asks
    "leangrpo-torchrun": 'echo "launcher $*" >> "$STUB_LOG"\n'
                         'case "$STUB_CASE" in\n'
                         '  bad) echo "error: every checkpoint of RUN is damaged" >&2; exit 2;;\n'
                         '  preempted) echo \'{"step": 3}\' > "$LEANGRPO_PREEMPTED_MARKER"; exit 138;;\n'
                         '  crash) exit 1;;\n'
                         'esac',
}


@pytest.mark.parametrize("case,code,requeued", [("bad", 2, False), ("crash", 1, False), ("preempted", 0, True)])
def test_the_slurm_example_requeues_a_preemption_save_and_nothing_else(tmp_path, case, code, requeued):
    """The sbatch script under stand-ins for srun, scontrol and the launcher: it launches ``leangrpo-torchrun``
    (not plain torchrun) with resume=auto before the user's overrides, requeues after a preemption save, and ends
    with the launcher's exit code otherwise (a job stopped on a damaged run directory stays failed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in _STUBS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_CASE": case,
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node-[0-1]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "train_slurm.sbatch"), "cfg.yaml",
                           "checkpoint.resume=fresh_if_damaged"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == code, done.stderr
    calls = log.read_text().splitlines()
    launcher = [c for c in calls if c.startswith("launcher ")]
    assert len(launcher) == 1 and "--nnodes 2 --nproc-per-node 8" in launcher[0]
    assert launcher[0].endswith("-m leangrpo_mcore.train --config cfg.yaml checkpoint.resume=auto "
                                "checkpoint.resume=fresh_if_damaged")  # the user's override comes last: it wins
    assert ("scontrol requeue 77" in calls) == requeued
    assert not (tmp_path / ".leangrpo-preempted-77").exists()


def test_resume_auto_without_a_checkpoint_starts_afresh_and_keeps_the_old_metrics(tmp_path, capsys):
    # What a launch killed before its first checkpoint leaves: metrics rows and no checkpoint.
    run = tmp_path / "run"
    run.mkdir()
    interrupted = json.dumps({"step": 1, "reward_mean": 123.0}) + "\n" + json.dumps({"step": 2}) + "\n"
    (run / "metrics.jsonl").write_text(interrupted)
    code, errors, output = _train(capsys, run, "train.max_steps=1")  # resume: null still refuses them
    assert code == 2 and "already holds the metrics of an earlier run" in errors[0], output
    code, errors, output = _train(capsys, run, "train.max_steps=1", "checkpoint.resume=auto")
    assert code == 0, output
    assert "no checkpoint to resume" in output and "kept as metrics.interrupted-1.jsonl" in output, output
    assert (run / "metrics.interrupted-1.jsonl").read_text() == interrupted
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] and rows[0]["reward_mean"] != 123.0


def test_laggard_is_the_rank_behind_every_other():
    phases = [Phase(0, 2, 4, "rollout and update"), Phase(1, 2, 3, "reward"), Phase(2, 3, 0, "text encoding")]
    assert [p.rank for p in laggard(phases)] == [1]
    tied = [Phase(0, 5, 2, "checkpoint save"), Phase(1, 5, 2, "checkpoint save")]
    assert [p.rank for p in laggard(tied)] == [0, 1]


def test_the_watchdog_ends_a_stalled_phase_with_one_line(tmp_path):
    script = textwrap.dedent("""
        import time
        from leangrpo_mcore.engine.control.watchdog import StepWatchdog
        dog = StepWatchdog(0.3, 0, 1, setting="train.step_timeout_minutes=0.005")
        dog.enter("reward", 7)
        time.sleep(30)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TORCHELASTIC_ERROR_FILE":
                               str(tmp_path / "error.json")})
    assert done.returncode == EXIT_STEP_TIMEOUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"error: step watchdog: rank 0 stalled in reward of step 7 \((0\.[3-9]|1\.\d) "
                                            r"s without progress, train\.step_timeout_minutes=0\.005\); stopping "
                                            r"the job", lines[0]), done.stderr
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert recorded == lines[0].removeprefix("error: ")
