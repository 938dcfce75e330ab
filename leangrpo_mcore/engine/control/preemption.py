"""Preemption: a signal asks the run to save the step it is in and stop.

SLURM and Kubernetes send SIGTERM some seconds before SIGKILL; SLURM's ``--signal=USR1@120`` sends SIGUSR1 two
minutes before the time limit; Ctrl-C is SIGINT. :class:`PreemptionFlag` installs handlers for the signals of
``train.save_on_signal`` that only record the signal (a handler may run between any two bytecodes, so it does
no I/O and no collective). After each optimizer step every rank calls :meth:`PreemptionFlag.agreed`, one
all-reduce of one number, so that all ranks stop after the same step even when the signal reached them at
different moments; the trainer then writes a synchronous checkpoint of that step and exits with
:func:`exit_code` (128 + the signal number, the shell's convention: 143 for SIGTERM, 130 for SIGINT, 138 for
SIGUSR1). Further signals change nothing until then; SIGKILL (or SIGQUIT, Ctrl-\\) stops at once.

Under torchrun the agent forwards the signals it handles to the workers: SIGTERM and SIGINT by default,
SIGUSR1 with ``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``; it kills the workers
``--shutdown-timeout`` seconds (default 30) later, which must cover the rest of a step and a save.

When ``LEANGRPO_PREEMPTED_MARKER`` names a file, rank 0 creates it after the save, so that a batch script can
tell a preempted run (requeue it) from a failed one (torchrun itself exits with 1 either way).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.engine.launch import collective_device
from leangrpo_mcore.engine.output.run_dir import RunDir

SIGNAL_NAMES = ("TERM", "INT", "USR1")
"""The signals ``train.save_on_signal`` may name."""
MARKER_ENV = "LEANGRPO_PREEMPTED_MARKER"
"""Environment variable naming the file rank 0 creates after a preemption save."""


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by signal ``signum`` after its save: 128 + ``signum``."""
    return 128 + int(signum)


class PreemptionFlag:
    """Signal handlers that record the first preemption signal; :meth:`restore` puts the old handlers back."""

    def __init__(self, names: list[str]) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; a trainer run elsewhere cannot catch them
        for name in names:
            signum = int(getattr(signal, f"SIG{name}"))
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        # Later signals change nothing: a worker often gets the same signal twice (from the scheduler, which
        # signals every process of the job, and forwarded by torchrun), and must still save.
        if not self.signum:
            self.signum = signum

    def agreed(self) -> int:
        """Collective over the default group: the largest signal number any rank has seen (0: none)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([float(self.signum)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        """Reinstall the handlers that were there before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name


def write_marker(step: int, signum: int, checkpoint: Optional[str]) -> Optional[str]:
    """Create the file ``LEANGRPO_PREEMPTED_MARKER`` names (if set) with the step, signal and checkpoint."""
    path = os.environ.get(MARKER_ENV)
    if not path:
        return None
    record = {"step": step, "signal": signal_name(signum), "checkpoint": checkpoint, "exit_code": exit_code(signum)}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    except OSError:
        return None  # the checkpoint is written all the same; only the automatic requeue is lost
    return path


def set_aside_interrupted(run_dir: RunDir) -> list[tuple[str, str]]:
    """Rename the metrics and eval rows of a launch that ended before its first checkpoint.

    ``checkpoint.resume: auto`` with no checkpoint to resume starts the run afresh; what the interrupted launch
    logged is kept as ``metrics.interrupted-<k>.jsonl`` (``eval.interrupted-<k>.jsonl``), ``k`` counting such
    launches, so that ``metrics.jsonl`` holds one run's steps. Returns the (old, new) paths renamed (rank 0).
    """
    moved = []
    for path in (run_dir.metrics_path, run_dir.eval_path):
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            continue
        stem, ext = os.path.splitext(path)
        k = 1
        while os.path.exists(f"{stem}.interrupted-{k}{ext}"):
            k += 1
        os.replace(path, f"{stem}.interrupted-{k}{ext}")
        moved.append((path, f"{stem}.interrupted-{k}{ext}"))
    return moved
