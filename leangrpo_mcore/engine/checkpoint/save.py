"""Writing a training checkpoint: every rank writes its own shards, synchronously or on a background thread.

:func:`save_checkpoint` writes the files of ``step_<N>`` into ``step_<N>.tmp-<id>``; :class:`PendingSave` then
publishes them (:mod:`~leangrpo_mcore.engine.checkpoint.publish`). A background write (``checkpoint.async_save``)
stages the shards on the host first and runs its collectives on a gloo group of its own. A run writes through
one :class:`CheckpointWriter`: one write at a time, each reported once and the old checkpoints pruned.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.engine.checkpoint.format import (FORMAT, OPTIM_FILE, STATE_FILE, VERSION, fsync_file, rank,
                                                     world, write_json)
from leangrpo_mcore.engine.checkpoint.publish import complete, prune, write_error
from leangrpo_mcore.engine.checkpoint.state import (merged_record, optimizer_record, rng_state, host_copy,
                                                    training_state)
from leangrpo_mcore.engine.launch import broadcast_object, collective_device
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.checkpoint import DCP_DIR, write_policy_checkpoint
from leangrpo_mcore.models.common.dcp_blocks import BlockSavePlanner, quiet_dcp
from leangrpo_mcore.models.common.tp import TPLayout
from leangrpo_mcore.models.registry import family_for_config
from leangrpo_mcore.parallel.mesh import default_group_timeout


@dataclass
class PendingSave:
    """A checkpoint whose files are being written; :meth:`finish` or :meth:`poll` (collective) report it.

    A synchronous save is verified and published by :meth:`finish`. A background write (``async_save``)
    verifies and publishes itself as soon as its files are written, so a crash after that point keeps the
    checkpoint; :meth:`poll` then reports it, or its one-line error, at the first step after it completed.
    """

    run_dir: RunDir
    tmp: str
    final: str
    step: int
    future: Optional[Future]
    """The background write's outcome: the published path, or the exception that stopped it."""
    error: Optional[UserError] = None

    def finish(self) -> str:
        """Collective: the published checkpoint's path (waiting for a background write), or the write's
        UserError, the same on every rank."""
        if self.future is None:
            return complete(self.tmp, self.final, self.step, self.error, None)
        try:
            return self.future.result()
        except UserError:
            raise
        except BaseException as err:  # noqa: BLE001 -- any storage failure becomes one line
            raise write_error(self.tmp, err) from None

    def poll(self) -> Optional[str]:
        """Collective: None while a background write still runs on some rank, else :meth:`finish`."""
        if self.future is None:
            return self.finish()
        running = torch.tensor([0.0 if self.future.done() else 1.0], device=collective_device())
        if world() > 1:
            dist.all_reduce(running, op=dist.ReduceOp.MAX)
        return None if running.item() > 0 else self.finish()


_WRITER_GROUP: Optional[dist.ProcessGroup] = None


def _writer_group() -> Optional[dist.ProcessGroup]:
    """A gloo group of its own for background writes, so that their collectives never interleave with the
    training collectives of the main thread (created once, collectively)."""
    global _WRITER_GROUP
    if world() > 1 and _WRITER_GROUP is None:
        _WRITER_GROUP = dist.new_group(backend="gloo", timeout=default_group_timeout())
    return _WRITER_GROUP


def _dcp_save(state: dict, folder: str, group: Optional[dist.ProcessGroup]) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(folder, sync_files=True, single_file_per_rank=True)
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, planner=BlockSavePlanner(), process_group=group,
                 no_dist=world() == 1)


def save_checkpoint(run_dir: RunDir, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    lr_scheduler: Any, ema: Optional[dict[str, torch.Tensor]], layout: TPLayout,
                    state: dict, config_yaml: str, async_save: bool = False) -> PendingSave:
    """Collective: start writing the checkpoint of ``step``; :meth:`PendingSave.finish` completes it.

    ``state`` is the JSON-able trainer state (step counter, sampler position, layout, counters). With
    ``async_save`` the shards are copied to the host and written, verified and published by a background
    thread (on a process group of its own); otherwise the files are written when this returns and
    :meth:`PendingSave.finish` publishes them.
    """
    final = run_dir.checkpoint_path(step)
    tmp = broadcast_object(f"{final}.tmp-{uuid.uuid4().hex[:8]}" if rank() == 0 else None)
    pending = PendingSave(run_dir, tmp, final, step, None)
    error: Optional[str] = None
    try:
        if rank() == 0:
            os.makedirs(os.path.join(tmp, "rng"))
            _write_small_files(tmp, step, model, state, config_yaml)
    except OSError as err:
        error = str(write_error(tmp, err))
    error = broadcast_object(error)
    if error:
        pending.error = UserError(error)
        return pending
    shards, scalars = training_state(model, optimizer, ema, layout)
    record = merged_record(optimizer_record(model, optimizer, lr_scheduler, scalars))
    try:
        if rank() == 0:
            write_json(os.path.join(tmp, OPTIM_FILE), record)
        rng_path = os.path.join(tmp, "rng", f"rank_{rank()}.pt")
        torch.save(rng_state(), rng_path)
        fsync_file(rng_path)
    except OSError as err:
        pending.error = write_error(tmp, err)
    folder = os.path.join(tmp, DCP_DIR)
    if async_save:
        group = _writer_group()
        staged = host_copy(shards)
        pending.future = Future()

        def write() -> None:
            error = pending.error
            try:
                _dcp_save(staged, folder, group)
            except BaseException as err:  # noqa: BLE001 -- DCP wraps every rank's storage error
                error = error or write_error(tmp, err)
            try:  # every rank reaches the collectives of complete(), failed or not
                pending.future.set_result(complete(tmp, final, step, error, group))
            except BaseException as err:  # noqa: BLE001 -- reported by finish() and poll()
                pending.future.set_exception(err)

        threading.Thread(target=write, name=f"checkpoint-step-{step}", daemon=True).start()
    else:
        try:
            _dcp_save(shards, folder, None)
        except BaseException as err:  # noqa: BLE001 -- DCP wraps every rank's storage error
            pending.error = pending.error or write_error(tmp, err)
    return pending


def _write_small_files(tmp: str, step: int, model: torch.nn.Module, state: dict, config_yaml: str) -> None:
    family = family_for_config(model.config)
    lora = getattr(model, "lora_config", None)
    write_policy_checkpoint(tmp, family=family.name, config=model.config.to_diffusers_config(),
                            lora=None if lora is None else lora.to_dict(), tensors=None)
    with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as fh:
        fh.write(config_yaml)
        fh.flush()
        os.fsync(fh.fileno())
    write_json(os.path.join(tmp, STATE_FILE), {"format": FORMAT, "version": VERSION, "step": step, **state})


class CheckpointWriter:
    """A run's checkpoint writes, one at a time: each published (at once, or by its background write as soon as
    its files are written), reported once every rank has it, and the old ones pruned (``keep_last``, rank 0)."""

    def __init__(self, run_dir: RunDir, *, keep_last: int, log: logging.Logger, is_main: bool) -> None:
        self.run_dir, self.keep_last, self.log, self.is_main = run_dir, keep_last, log, is_main
        self.pending: Optional[PendingSave] = None
        """The write in progress (None: none)."""

    def save(self, step: int, *, background: bool, **contents: Any) -> str:
        """Collective: wait for the previous write, then write the checkpoint of ``step`` (``contents``: the
        keywords of :func:`save_checkpoint`): published before this returns, or with ``background`` by a
        background thread; returns its final path."""
        self.finish()
        self.pending = save_checkpoint(self.run_dir, step, async_save=background, **contents)
        if not background:
            self.finish()
        return self.run_dir.checkpoint_path(step)

    @property
    def running(self) -> bool:
        """Whether this rank's background write is still running (what the ranks agree on before :meth:`poll`)."""
        pending = self.pending
        return pending is not None and pending.future is not None and not pending.future.done()

    def poll(self, running_anywhere: bool) -> None:
        """Report a background write once ``running_anywhere`` (:attr:`running` of every rank, agreed in the
        step's one control collective) says it is done on every rank: its path, or its one-line error, which stops
        the run at the first step after it failed; nothing while it runs."""
        pending = self.pending
        if pending is None or pending.future is None or running_anywhere:
            return
        self.pending = None
        self._published(pending.finish())

    def finish(self) -> None:
        """Wait for the checkpoint being written (publishing a synchronous one), then prune."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._published(pending.finish())

    def _published(self, path: str) -> None:
        if self.is_main:
            for gone in prune(self.run_dir, self.keep_last, newest=path):
                self.log.info("removed old checkpoint %s", gone)
        self.log.info("saved checkpoint %s", path)
