"""One trainer per run directory: an advisory lock file ``RUN/.lock`` held by rank 0 for the run's life.

The lock is an ``fcntl.flock`` on the file, so the kernel releases it when the holder exits, however it exits
(``kill -9`` included); the file's text names the holder (host and pid) for the error message of a second
trainer. A lock file whose flock is free but whose text names another process is what a holder that died left
behind: it is taken over with a warning. The file itself is never deleted (deleting a lock file lets a third
process lock a fresh inode while a second still holds the old one); a clean release empties it.

``flock`` works across the nodes of NFSv4 and Lustre (mounted with ``flock``); on a file system without it the
lock cannot be taken and the run says so in one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from leangrpo_mcore.engine.launch import raise_if_any
from leangrpo_mcore.errors import UserError

LOCK_NAME = ".lock"
"""The lock file's name inside ``train.output_dir``."""


@dataclass
class Holder:
    """Who holds (or last held) a run directory's lock."""

    host: str
    """Host name of the holder."""
    pid: int
    """Process id of the holder on ``host``."""

    def describe(self) -> str:
        """``pid 1234 on host node07``."""
        return f"pid {self.pid} on host {self.host}"


def read_holder(path: str) -> Optional[Holder]:
    """The holder a lock file names, or None (empty, missing or unreadable file)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read() or "null")
        return Holder(str(data["host"]), int(data["pid"])) if isinstance(data, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """The held lock of one run directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, path: str, fd: int, created_root: bool = False) -> None:
        self.path = path
        self._fd: Optional[int] = fd
        self._created_root = created_root

    @classmethod
    def acquire(cls, root: str, warn: Optional[Callable[[str], Any]] = None) -> "RunLock":
        """Lock ``root/.lock`` (creating ``root``); UserError naming the holder when another trainer holds it."""
        if os.path.exists(root) and not os.path.isdir(root):
            raise UserError(f"train.output_dir '{root}' exists and is not a directory")
        created = not os.path.exists(root)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create train.output_dir '{root}': {err.strerror}") from None
        path = os.path.join(root, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise UserError(f"cannot open the run lock {path}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock {path}: {err.strerror} (the file system of train.output_dir must "
                                f"support flock)") from None
            holder = read_holder(path)
            who = holder.describe() if holder else "another process"
            raise UserError(f"train.output_dir '{root}' is in use by another trainer ({who}, lock file {path}); "
                            f"wait for it to end or choose another train.output_dir") from None
        previous = read_holder(path)
        me = Holder(socket.gethostname(), os.getpid())
        if previous is not None and previous != me and warn is not None:
            state = ("no longer running" if previous.host == me.host and not pid_alive(previous.pid)
                     else "no longer holding it")
            warn(f"taking over the stale lock {path} of {previous.describe()} ({state})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": me.host, "pid": me.pid}).encode(), 0)
        os.fsync(fd)
        return cls(path, fd, created)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Empty the lock file and free the lock (idempotent). A directory this lock created and nothing else
        wrote into (a launch refused while building) is removed, so that bad input leaves no trace."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        root = os.path.dirname(self.path)
        try:
            if self._created_root and os.listdir(root) == [LOCK_NAME]:
                # Unlinked while still locked, so a launch starting now fails to lock or creates a new file;
                # only one that opened the old file in the instant before the unlink would miss this lock.
                os.unlink(self.path)
                os.rmdir(root)
            else:
                os.ftruncate(fd, 0)
        except OSError:
            pass  # the lock is freed below all the same; a stale text only costs a warning later
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_run_dir(root: str, warn: Optional[Callable[[str], Any]] = None) -> Optional[RunLock]:
    """Collective: rank 0 takes the lock of ``root``; when it cannot, every rank raises its UserError.

    Returns the held lock on rank 0 and None elsewhere.
    """
    held, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            held = RunLock.acquire(root, warn)
        except UserError as err:
            error = str(err)
    raise_if_any(error)
    return held
