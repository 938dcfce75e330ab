"""Preemption: a signal asks the run to save the step it is in and stop.

SLURM and Kubernetes send SIGTERM some seconds before SIGKILL; SLURM's ``--signal=USR1@120`` sends SIGUSR1 two
minutes before the time limit; Ctrl-C is SIGINT. :class:`PreemptionFlag` installs handlers for the signals of
``train.save_on_signal`` that only record the signal (a handler may run between any two bytecodes, so it does
no I/O and no collective). After each optimizer step every rank takes part in one all-reduce of the largest
signal seen (:func:`agree_after_step`, which carries the step's other flags in the same collective), so that all
ranks stop after the same step even when the signal reached them at different moments; the trainer then writes
a synchronous checkpoint of that step and exits with
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
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.engine.launch import collective_device
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.errors import write_error_file

SIGNAL_NAMES = ("TERM", "INT", "USR1")
"""The signals ``train.save_on_signal`` may name."""
MARKER_ENV = "LEANGRPO_PREEMPTED_MARKER"
"""Environment variable naming the file rank 0 creates after a preemption save."""


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by signal ``signum`` after its save: 128 + ``signum``."""
    return 128 + int(signum)


PhaseClock = Callable[[], tuple[str, int, float]]
"""(phase name, step, ``time.monotonic()`` when the rank entered that phase)."""


class PreemptionFlag:
    """Signal handlers that record the first preemption signal; :meth:`restore` puts the old handlers back.

    With ``stalled_after_s`` and ``phase``, a signal also wakes a watcher thread: a rank that has been in one phase
    (``phase()``) for longer than ``stalled_after_s`` (the process groups' timeout) cannot be waited for, since any
    peer waiting on it in a collective has given up already (torchrun signals the other ranks after one of them
    failed); it exits at once with :func:`exit_code` and one line, instead of ignoring the signal until torchrun's
    shutdown timeout kills it. A rank making progress finishes its step and saves.
    """

    def __init__(self, names: list[str], *, stalled_after_s: Optional[float] = None,
                 phase: Optional[PhaseClock] = None, rank: int = 0, setting: str = "") -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._signalled = threading.Event()
        self._closed = False
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; a trainer run elsewhere cannot catch them
        for name in names:
            signum = int(getattr(signal, f"SIG{name}"))
            self._previous[signum] = signal.signal(signum, self._handle)
        if self._previous and stalled_after_s is not None and phase is not None:
            threading.Thread(target=self._watch, args=(stalled_after_s, phase, rank, setting),
                             name="preemption-watch", daemon=True).start()

    def _handle(self, signum: int, frame: Any) -> None:
        # Later signals change nothing: a worker often gets the same signal twice (from the scheduler, which
        # signals every process of the job, and forwarded by torchrun), and must still save.
        if not self.signum:
            self.signum = signum
            self._signalled.set()

    def _watch(self, limit_s: float, phase: PhaseClock, rank: int, setting: str) -> None:
        """After a signal: exit this process as soon as its current phase has lasted longer than ``limit_s``."""
        self._signalled.wait()
        while not self._closed:
            name, step, since = phase()
            age = time.monotonic() - since
            if age > limit_s:
                message = (f"{signal_name(self.signum)} reached rank {rank} stalled in {name} of step {step} for "
                           f"{age:.0f} s, longer than {setting}: its peers have given up on it, so it stops now "
                           f"without saving")
                print(f"[leangrpo {rank}] {message}", file=sys.stderr, flush=True)
                write_error_file(message)
                os._exit(exit_code(self.signum))
            time.sleep(min(0.2, limit_s - age + 0.01))

    def restore(self) -> None:
        """Reinstall the handlers that were there before (and end the watcher thread)."""
        self._closed = True
        self._signalled.set()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


@dataclass(frozen=True)
class StepControl:
    """What every rank agrees on after a step, in one collective (:func:`agree_after_step`)."""

    signum: int
    """The largest preemption signal any rank has seen (0: none)."""
    io_failed: bool
    """Some rank failed to write the run's files (metrics, samples, TensorBoard, wandb)."""
    saving: bool
    """A background checkpoint write still runs on some rank."""


def agree_after_step(signum: int, io_failed: bool, saving: bool) -> StepControl:
    """Collective over the default group: one all-reduce (MAX) of this rank's preemption signal, failed-write flag
    and running background write, the three things a step's end decides on, instead of one collective each."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return StepControl(int(signum), bool(io_failed), bool(saving))
    flags = torch.tensor([float(signum), float(io_failed), float(saving)], device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    agreed, failed, running = flags.tolist()
    return StepControl(int(agreed), failed > 0, running > 0)


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
