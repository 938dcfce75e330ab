"""Spawn N gloo ranks from inside pytest.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forked from a fork server that has imported torch, megatron-core and
the project once), each with a fresh
gloo process group on a free loopback port, calls ``fn(rank, world_size, *args)`` and returns the
list of per-rank return values (which must be picklable). A rank that raises makes the call fail
with that rank's traceback; a run that exceeds ``timeout`` seconds is killed and fails, naming the
ranks that did not finish. ``fn`` must be a module-level function so that it can be pickled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, environ, init) -> None:
    # a forked rank inherits the fork server's environment, not the test's (which may have changed since)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensor data; the queue's own pickler would pass shared-memory handles that
        # vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Every rank would otherwise import torch, megatron-core and the project afresh (several CPU seconds each): a
# fork server imports them once per test process and forks each rank from that clean, single-threaded state.
_PRELOAD = ["torch", "torch.distributed", "megatron.core.tensor_parallel", "leangrpo_mcore.engine.trainer"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
              init: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result. With
    ``init=False`` the ranks start without a process group (``fn`` makes its own from the torchrun-style
    environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A port that another process took between
    :func:`free_port` and the rendezvous (EADDRINUSE, before ``fn`` did any work) is replaced, twice at most."""
    for attempt in range(3):
        try:
            return _run_ranks_on(free_port(), fn, world_size, args, timeout, init)
        except RuntimeError as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks_on(port: int, fn: Callable[..., Any], world_size: int, args: tuple, timeout: float,
                  init: bool) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, results, dict(os.environ), init), daemon=False)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                raise TimeoutError(f"distributed test timed out after {timeout:.0f}s; ranks {missing} did not finish")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs and r not in errors]
                if dead:
                    errors.update({r: f"rank {r} died with exit code {procs[r].exitcode}" for r in dead})
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break  # the other ranks may now block in a collective: do not wait for them
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"distributed test failed on ranks {sorted(errors)}:\n{report}")
    return [outputs[r] for r in range(world_size)]


def _train(rank: int, world_size: int, argv: list[str]) -> int:
    from leangrpo_mcore.cli.train import main

    return main(argv)


def train_ranks(*argv: str, nproc: int = 2, timeout: float = 300.0) -> None:
    """``leangrpo-train argv`` on ``nproc`` local gloo ranks, each started as torchrun starts a rank (its
    environment, no process group yet); fails unless every rank exits with 0."""
    codes = run_ranks(_train, nproc, list(argv), timeout=timeout, init=False)
    assert codes == [0] * nproc, f"leangrpo-train exited with {codes}"


def train_capturing(argv: list) -> tuple:
    """(exit code, the 'error:' lines, whether a traceback was printed) of one in-process ``leangrpo-train`` run on
    this rank."""
    import contextlib
    import io

    from leangrpo_mcore.cli.train import main as train_main

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream):
        code = train_main(argv)
    text = stream.getvalue()
    return code, [line for line in text.splitlines() if line.startswith("error:")], "Traceback" in text
