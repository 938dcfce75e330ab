"""The step watchdog (``train.step_timeout_minutes``): a stalled rank ends the job in one line, not in a hang.

The trainer names the phase each rank is in (:meth:`StepWatchdog.enter`); a background thread on every rank
publishes that phase to the job's key-value store (torchrun's, or the default group's rendezvous store at
``MASTER_ADDR:MASTER_PORT``) and, once its own phase has lasted longer than the timeout, reads every rank's
phase and names the one that is behind: the rank whose step, then whose phase within the step, is the
earliest. A rank waiting in a collective has moved on to the phase that needs its peers, so the rank that
stalled (a reward that never returns, a dead file system) is the one still in the earlier phase.

The first rank to fire prints the one ``error:`` line (the store counts who reports); every rank writes it to
torchrun's error file and ends with exit code :data:`EXIT_STEP_TIMEOUT` without unwinding, since its main
thread is blocked where no exception can reach it. The process-group timeout (``parallel.timeout_minutes``)
stays the last resort for what the watchdog does not cover.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from leangrpo_mcore.errors import write_error_file

EXIT_STEP_TIMEOUT = 124
"""Exit code of a rank the watchdog stopped (``timeout``'s convention)."""
_KEY = "leangrpo/watchdog"


@dataclass
class Phase:
    """Where one rank is."""

    rank: int
    """Global rank."""
    step: int
    """The optimizer step (0 before the first)."""
    index: int
    """Phases entered so far in this step (orders the phases of one step)."""
    name: str
    """What the rank does: text encoding, rollout and update, reward, samples, checkpoint save, evaluation."""
    seconds: float = 0.0
    """How long it has been in this phase when it was read."""


def _store(world_size: int) -> Optional[dist.Store]:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size <= 1 or not addr or not port:
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    except (RuntimeError, ValueError, OSError):
        return None  # no store: each rank then names only itself


def laggard(phases: list[Phase]) -> list[Phase]:
    """The ranks that are behind every other: the earliest (step, phase index)."""
    first = min((p.step, p.index) for p in phases)
    return [p for p in phases if (p.step, p.index) == first]


class StepWatchdog:
    """Per-rank phase tracker and the thread that stops the job when a phase outlasts ``timeout_s``."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, setting: str) -> None:
        self.timeout_s, self.rank, self.world_size, self.setting = timeout_s, rank, world_size, setting
        self._lock = threading.Lock()
        self._phase = Phase(rank, 0, 0, "start")
        self._since: Optional[float] = None  # None: not timing (outside the training loop)
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def enter(self, name: str, step: Optional[int] = None) -> None:
        """Start timing phase ``name`` (of ``step``, or of the current step)."""
        with self._lock:
            p = self._phase
            new_step = p.step if step is None else step
            self._phase = Phase(self.rank, new_step, p.index + 1 if new_step == p.step else 0, name)
            self._since = time.monotonic()

    def pause(self) -> None:
        """Stop timing (between the training loop and what follows it)."""
        with self._lock:
            self._since = None

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _snapshot(self) -> tuple[Phase, Optional[float]]:
        with self._lock:
            return self._phase, self._since

    def _watch(self) -> None:
        store = _store(self.world_size)
        poll = min(max(self.timeout_s / 10, 0.05), 5.0)
        published = None
        while not self._stop.wait(poll):
            phase, since = self._snapshot()
            if since is None:
                continue
            if store is not None and published != (phase.step, phase.index):
                published = (phase.step, phase.index)
                self._publish(store, phase, since)
            if time.monotonic() - since > self.timeout_s:
                self._fire(store, phase, time.monotonic() - since)
                return

    def _publish(self, store: dist.Store, phase: Phase, since: float) -> None:
        record = {"step": phase.step, "index": phase.index, "name": phase.name, "since": time.time() - (
            time.monotonic() - since)}
        try:
            store.set(f"{_KEY}/{self._attempt}/{self.rank}", json.dumps(record))
        except (RuntimeError, OSError):
            pass  # the store is gone (its host ended): the report falls back to this rank

    def _phases(self, store: Optional[dist.Store], mine: Phase) -> list[Phase]:
        if store is None:
            return [mine]
        phases = [mine]
        now = time.time()
        for rank in range(self.world_size):
            key = f"{_KEY}/{self._attempt}/{rank}"
            if rank == self.rank:
                continue
            try:
                if not store.check([key]):
                    phases.append(Phase(rank, 0, -1, "start-up"))
                    continue
                data = json.loads(store.get(key))
            except (RuntimeError, OSError, ValueError):
                continue
            phases.append(Phase(rank, int(data["step"]), int(data["index"]), str(data["name"]),
                                now - float(data["since"])))
        return phases

    def _fire(self, store: Optional[dist.Store], mine: Phase, seconds: float) -> None:
        mine.seconds = seconds
        behind = laggard(self._phases(store, mine))
        ranks = ", ".join(str(p.rank) for p in behind)
        p = behind[0]
        where = f"in {p.name} of step {p.step}" if p.step else f"in {p.name}"
        message = (f"step watchdog: rank{'s' if len(behind) > 1 else ''} {ranks} stalled {where} "
                   f"({max(q.seconds for q in behind):.1f} s without progress, {self.setting}); stopping the job")
        report = True
        if store is not None:
            try:
                report = store.add(f"{_KEY}/{self._attempt}/reported", 1) == 1
            except (RuntimeError, OSError):
                report = self.rank == 0
        if report:
            print(f"error: {message}", file=sys.stderr, flush=True)
        write_error_file(message)
        sys.stdout.flush()
        os._exit(EXIT_STEP_TIMEOUT)
