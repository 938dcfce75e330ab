"""Process-group start-up for training and a rank-aware logger.

``torchrun`` (or SLURM through torchrun) sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``;
:func:`init_distributed` joins that group with NCCL when CUDA is available and gloo otherwise. Without those
variables (``leangrpo-train`` run directly) it starts a one-rank group on an in-memory store, so the rest of the
code always sees an initialised default group. A group that already exists (a test harness) is adopted and left
alone at shutdown.

Only rank 0 logs at INFO; other ranks log warnings and errors only. Bad input is one
:class:`~leangrpo_mcore.errors.UserError` line, the same on every rank (:func:`user_errors`, :func:`raise_if_any`,
:func:`first_error`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.rl.rewards import RewardError

LOGGER_NAME = "leangrpo"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistContext:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank within the node (selects the GPU)."""
    device: torch.device
    """cuda:<local_rank> when CUDA is available, else cpu."""
    backend: str
    """nccl or gloo."""
    owns_group: bool
    """Whether :func:`shutdown` destroys the default process group (False when it was adopted)."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def quiet_nonzero_ranks() -> None:
    """Silence Python warnings on every rank but 0 (torchrun's ``RANK``); call before the heavy imports."""
    if os.environ.get("RANK", "0") != "0":
        warnings.simplefilter("ignore")


def pick_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the default process group; see the module docstring for the three cases."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        device = _device_for(local_rank)
        return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend(), False)
    backend = pick_backend()
    device = _device_for(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if all(name in os.environ for name in _TORCHRUN_VARS):
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method="env://", timeout=timeout, **kwargs)
    else:
        # A lone process: a one-rank group on an in-memory store (no port, no rendezvous).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, True)


def shutdown(ctx: Optional[DistContext]) -> None:
    """Destroy the default process group if :func:`init_distributed` created it."""
    if ctx is not None and ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        """Tag the record with the rank; pass everything on rank 0, only warnings and errors elsewhere."""
        record.rank = self.rank
        return self.rank == 0 or record.levelno >= logging.WARNING


def get_logger(rank: Optional[int] = None) -> logging.Logger:
    """The project logger; the first call with a ``rank`` installs a stderr handler that quiets non-zero ranks."""
    logger = logging.getLogger(LOGGER_NAME)
    if rank is not None:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[leangrpo %(rank)s] %(message)s"))
        handler.addFilter(_RankFilter(rank))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def collective_device() -> torch.device:
    """Where small tensors for collectives of the default group live: cuda for NCCL, cpu otherwise."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_to_report() -> bool:
    """Whether this process prints the job's one-line error: the first rank of the job to fail does.

    Under torchrun the failing ranks count themselves on the launcher's own store (one atomic add, no
    collective and no process group needed, so ranks failing together and a rank failing alone both print
    exactly one line). A lone process reports; any other multi-process launch leaves it to rank 0 (``RANK``).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and addr and port:
        try:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=10),
                                  wait_for_workers=False)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return store.add(f"leangrpo/errors_reported/{attempt}", 1) == 1
        except (RuntimeError, ValueError, OSError):
            pass  # the launcher's store is gone: fall back to rank 0
    return os.environ.get("RANK", "0") == "0"


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (identity in a one-rank job)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the project's bad-input errors (ValueError with a one-line message, RewardError) into UserError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, RewardError) as err:
        lines = str(err).strip().splitlines()
        raise UserError(lines[0] if lines else type(err).__name__) from err


def raise_if_any(error: Optional[str]) -> None:
    """Collective: if any rank passes an error message, every rank raises :class:`UserError` with the first one.

    Used where only some ranks can detect a bad input (a reward on the ranks holding a sample), so that all
    ranks stop with the same one-line error instead of the others hanging in the next collective.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error:
            raise UserError(error)
        return
    flag = torch.tensor([1.0 if error else 0.0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0.0:
        return
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)
    first = next(m for m in messages if m)
    raise UserError(first)


def first_error(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on rank 0 only, share its result; a :class:`UserError` there is raised on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    outcome: tuple[Optional[str], Any] = (None, None)
    if rank == 0:
        try:
            outcome = (None, fn(*args, **kwargs))
        except UserError as err:
            outcome = (str(err), None)
    error, value = broadcast_object(outcome)
    if error:
        raise UserError(error)
    return value


def explain_timeout(err: BaseException, timeout_s: float) -> Optional[str]:
    """The one line for a collective that ran into the process-group timeout, naming the key; None for any other
    error (gloo says "Timed out waiting ...ms", NCCL "... timed out"; NCCL's watchdog usually ends the process
    itself first)."""
    text = str(err)
    distributed = isinstance(err, dist.DistError) or "gloo" in text
    if not distributed or "timed out" not in text.lower():
        return None
    return (f"a collective waited {timeout_s:g} s (parallel.timeout_minutes={timeout_s / 60.0:g}) for a rank that "
            f"never joined it: that rank stalled or died ({text.splitlines()[0]})")
