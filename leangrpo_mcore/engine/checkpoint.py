"""Training checkpoints: sharded (each rank writes its own shards), verified, reshardable on load.

A checkpoint ``OUTPUT_DIR/checkpoints/step_<N>/`` holds::

    dcp/                  torch.distributed.checkpoint files: every rank's shards of the model
                          (``model/<name>``), optimizer state (``optim/<name>/<key>``) and EMA (``ema/<name>``),
                          each stored as boxes of the FULL tensor; modules' extra state (Transformer Engine's
                          FP8 metadata) per TP rank (``extra/<module>._extra_state/tp_<r>``, see
                          :mod:`~leangrpo_mcore.engine.extra_state`)
    leangrpo_model.json   the policy's family, hyper-parameters and LoRA record (``leangrpo-convert`` and
                          ``model.path`` read the weights from ``dcp/``)
    optimizer.json        parameter groups, non-tensor optimizer state, LR-schedule position
    rng/rank_<r>.pt       python, numpy, torch CPU and CUDA generator states of rank r
    trainer_state.json    step, data sampler position, world/TP layout, counters
    config.yaml           the resolved config of the run that wrote it
    COMPLETE              written last: every file above with its size and CRC-32

Nothing is gathered: a rank's shards go to disk as they are (see
:mod:`~leangrpo_mcore.models.common.dcp_blocks` for how a TP slice's FSDP2 shard becomes boxes of the FULL
tensor), so the host memory of a save is at most one rank's shards. On load each rank reads the boxes it
needs at its own layout, which is what makes a checkpoint load at any world size, FSDP2/HSDP degree and TP
degree. The whole write goes into ``step_<N>.tmp-<id>`` and is renamed into place after the marker, so a
crash mid-save leaves only a ``.tmp-`` directory that resume never picks and the next launch removes. A crash
after the marker (before the rename, or between the two renames that replace an existing ``step_<N>``) leaves a
complete copy under a ``.tmp-`` name: ``checkpoint.resume=auto`` puts it back in place and nothing deletes it.

FSDP2 drops the megatron TP attributes of parameters when it wraps them, so the trainer records them first with
:func:`~leangrpo_mcore.models.common.tp.capture_tp_layout` (also here) and passes that map to save and load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from leangrpo_mcore.engine import ckpt_manifest as manifest
from leangrpo_mcore.engine.checkpoint_verify import verify_before_reading
from leangrpo_mcore.engine import extra_state
from leangrpo_mcore.engine.launch import broadcast_object, collective_device, first_error, get_logger
from leangrpo_mcore.engine.run_dir import STEP_ANY, STEP_DIR, RunDir, is_complete
from leangrpo_mcore.errors import UserError, exception_line
from leangrpo_mcore.models.common.checkpoint import DCP_DIR, CheckpointError, write_policy_checkpoint
from leangrpo_mcore.models.common.dcp_blocks import (Block, BlockLoadPlanner, BlockSavePlanner, BlockTensor,
                                                     block_tensor, quiet_dcp)
from leangrpo_mcore.models.common.dcp_source import data_files, dcp_failure, read_dcp_metadata
from leangrpo_mcore.models.common.tp import TPLayout, capture_tp_layout, tp_rank, tp_world_size  # noqa: F401
from leangrpo_mcore.models.registry import family_for_config
from leangrpo_mcore.parallel.mesh import default_group_timeout

MARKER = manifest.MARKER
FRESH_IF_DAMAGED = "fresh_if_damaged"
"""``checkpoint.resume``: as ``auto``, but a run directory whose every checkpoint is damaged starts afresh."""
STATE_FILE = "trainer_state.json"
OPTIM_FILE = "optimizer.json"
FORMAT = "leangrpo_mcore.train_checkpoint"
VERSION = 3
"""3: the policy's fused q/k/v and FLUX's single-block ``proj_out`` in their per-head layouts. Modules' extra
state (``extra/`` keys) came later without a bump: its entries sit beside the others, so a version-3 checkpoint
without them still loads (with a warning for modules that keep extra state) and older readers skip them."""

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _blocks(tensor: torch.Tensor, stub: torch.Tensor) -> BlockTensor:
    return block_tensor(tensor, stub, tp_rank(), tp_world_size())


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > 0 and tuple(value.shape) == tuple(param.shape)


# ---------------------------------------------------------------------------------------------- state dicts


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   ema: Optional[dict[str, torch.Tensor]], layout: TPLayout) -> tuple[dict, dict]:
    """(the flat DCP state dict of this rank's shards, the JSON-able non-tensor optimizer state)."""
    state: dict[str, Any] = {f"model/{name}": _blocks(p, layout[name]) for name, p in model.named_parameters()}
    names, scalars = _param_names(model), {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if _is_param_shaped(value, p):
                    state[f"optim/{name}/{key}"] = _blocks(value, layout[name])
                elif isinstance(value, torch.Tensor) and value.ndim == 0:
                    state[f"optim/{name}/{key}"] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = value
    for name, shadow in sorted((ema or {}).items()):
        state[f"ema/{name}"] = _blocks(shadow, layout[name])
    state.update(extra_state.save_entries(model, tp_rank()))
    return state, scalars


def _optimizer_record(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                      scalars: dict) -> dict:
    names = _param_names(model)
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["param_names"] = [names[id(p)] for p in group["params"]]
        groups.append(hyper)
    sched = None
    if lr_scheduler is not None:
        sched = {"last_epoch": int(lr_scheduler.last_epoch), "step_count": int(lr_scheduler._step_count)}
    return {"param_groups": groups, "scalars": scalars, "lr_scheduler": sched}


def _merged_record(record: dict) -> dict:
    """Collective: the optimizer record of the whole model. Pipeline stages hold different parameters; their
    names are joined in rank order (stage after stage: the whole model's order), each group's scalars merged."""
    if _world() == 1:
        return record
    records: list = [None] * _world()
    dist.all_gather_object(records, record)
    merged = records[0]
    for other in records[1:]:
        for group, theirs in zip(merged["param_groups"], other["param_groups"]):
            known = set(group["param_names"])
            group["param_names"].extend(n for n in theirs["param_names"] if n not in known)
        for name, values in other["scalars"].items():
            merged["scalars"].setdefault(name, values)
    return merged


def _staged(state: dict) -> dict:
    """A host copy of ``state`` that later training steps cannot change (for a background write)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, BlockTensor):
            out[key] = BlockTensor(value.shape, [Block(b.offsets, b.data.to("cpu", copy=True))
                                                 for b in value.blocks], value.dtype)
        elif isinstance(value, bytes):  # a serialized extra state: immutable already
            out[key] = value
        else:
            out[key] = value.to("cpu", copy=True)
    return out


# ------------------------------------------------------------------------------------------------- saving


def _write_error(tmp: str, err: BaseException) -> UserError:
    """The one-line error of a failed write, naming the file where the OS said which."""
    seen, found = [err], None
    while seen:
        exc = seen.pop()
        if isinstance(exc, OSError):
            found = exc
            break
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):  # DCP: {rank: (exception, traceback summary)}
            for value in failures.values():
                value = value[0] if isinstance(value, tuple) and value else value
                if isinstance(value, BaseException):
                    seen.append(value)
        for nxt in (exc.__cause__, exc.__context__):
            if nxt is not None:
                seen.append(nxt)
    if found is not None:
        where = found.filename or tmp
        return UserError(f"cannot write checkpoint: {where}: {found.strerror or found}")
    lines = str(err).strip().splitlines()
    return UserError(f"cannot write checkpoint {tmp}: {type(err).__name__}: {lines[-1] if lines else ''}")


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
            return _complete(self.tmp, self.final, self.step, self.error, None)
        try:
            return self.future.result()
        except UserError:
            raise
        except BaseException as err:  # noqa: BLE001 -- any storage failure becomes one line
            raise _write_error(self.tmp, err) from None

    def poll(self) -> Optional[str]:
        """Collective: None while a background write still runs on some rank, else :meth:`finish`."""
        if self.future is None:
            return self.finish()
        running = torch.tensor([0.0 if self.future.done() else 1.0], device=collective_device())
        if _world() > 1:
            dist.all_reduce(running, op=dist.ReduceOp.MAX)
        return None if running.item() > 0 else self.finish()


def _broadcast(obj: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """``obj`` of rank 0 on every rank of ``group`` (the default group for None)."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _complete(tmp: str, final: str, step: int, error: Optional[UserError],
              group: Optional[dist.ProcessGroup]) -> str:
    """Collective over ``group``: checksum each rank's files, write the marker and rename ``tmp`` into place
    (rank 0); returns ``final`` or raises the first rank's UserError on every rank (``tmp`` removed)."""
    files: dict[str, dict] = {}
    if error is None:
        try:
            files = manifest.describe(tmp, _own_files(tmp, _rank()))
        except OSError as err:
            error = _write_error(tmp, err)
    gathered = [(None if error is None else str(error), files)]
    if _world() > 1:
        gathered = [None] * _world()
        dist.all_gather_object(gathered, (None if error is None else str(error), files), group=group)
    problems = [e for e, _ in gathered if e]
    if problems:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(problems[0])
    outcome: Optional[str] = None
    if _rank() == 0:
        try:
            merged = {rel: entry for _, part in gathered for rel, entry in part.items()}
            missing = sorted(set(manifest.files_under(tmp)) - set(merged))
            merged.update(manifest.describe(tmp, missing))
            manifest.write_marker(tmp, step, merged)
            _publish(tmp, final)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = str(_write_error(tmp, err))
    outcome = _broadcast(outcome, group)
    if outcome:
        raise UserError(outcome)
    return final


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into ``tmp`` (DCP names its data files ``__<rank>_<n>.distcp``)."""
    mine = [f"rng/rank_{rank}.pt"]
    folder = os.path.join(tmp, DCP_DIR)
    if os.path.isdir(folder):
        mine += [f"{DCP_DIR}/{name}" for name in sorted(os.listdir(folder)) if name.startswith(f"__{rank}_")]
    return mine


def _publish(tmp: str, final: str) -> None:
    _fsync_file(tmp)
    if os.path.exists(final):
        # Re-saving a step (a run resumed from an older checkpoint): move the old one aside, then drop it.
        trash = f"{final}.tmp-replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_file(os.path.dirname(final))


_WRITER_GROUP: Optional[dist.ProcessGroup] = None


def _writer_group() -> Optional[dist.ProcessGroup]:
    """A gloo group of its own for background writes, so that their collectives never interleave with the
    training collectives of the main thread (created once, collectively)."""
    global _WRITER_GROUP
    if _world() > 1 and _WRITER_GROUP is None:
        _WRITER_GROUP = dist.new_group(backend="gloo", timeout=default_group_timeout())
    return _WRITER_GROUP


def _dcp_save(state: dict, folder: str, group: Optional[dist.ProcessGroup]) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(folder, sync_files=True, single_file_per_rank=True)
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, planner=BlockSavePlanner(), process_group=group,
                 no_dist=_world() == 1)


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
    tmp = broadcast_object(f"{final}.tmp-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None)
    pending = PendingSave(run_dir, tmp, final, step, None)
    error: Optional[str] = None
    try:
        if _rank() == 0:
            os.makedirs(os.path.join(tmp, "rng"))
            _write_small_files(tmp, step, model, state, config_yaml)
    except OSError as err:
        error = str(_write_error(tmp, err))
    error = broadcast_object(error)
    if error:
        pending.error = UserError(error)
        return pending
    shards, scalars = training_state(model, optimizer, ema, layout)
    record = _merged_record(_optimizer_record(model, optimizer, lr_scheduler, scalars))
    try:
        if _rank() == 0:
            _write_json(os.path.join(tmp, OPTIM_FILE), record)
        rng_path = os.path.join(tmp, "rng", f"rank_{_rank()}.pt")
        torch.save(rng_state(), rng_path)
        _fsync_file(rng_path)
    except OSError as err:
        pending.error = _write_error(tmp, err)
    folder = os.path.join(tmp, DCP_DIR)
    if async_save:
        group = _writer_group()
        staged = _staged(shards)
        pending.future = Future()

        def write() -> None:
            error = pending.error
            try:
                _dcp_save(staged, folder, group)
            except BaseException as err:  # noqa: BLE001 -- DCP wraps every rank's storage error
                error = error or _write_error(tmp, err)
            try:  # every rank reaches the collectives of _complete, failed or not
                pending.future.set_result(_complete(tmp, final, step, error, group))
            except BaseException as err:  # noqa: BLE001 -- reported by finish() and poll()
                pending.future.set_exception(err)

        threading.Thread(target=write, name=f"checkpoint-step-{step}", daemon=True).start()
    else:
        try:
            _dcp_save(shards, folder, None)
        except BaseException as err:  # noqa: BLE001 -- DCP wraps every rank's storage error
            pending.error = pending.error or _write_error(tmp, err)
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
    _write_json(os.path.join(tmp, STATE_FILE), {"format": FORMAT, "version": VERSION, "step": step, **state})


# --------------------------------------------------------------------------------------- finding, pruning


def list_complete(run_dir: RunDir) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint with a marker, oldest first (not yet verified)."""
    found = []
    for name in run_dir.existing_checkpoints():
        match = STEP_DIR.match(name)
        path = os.path.join(run_dir.checkpoints_dir, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def set_aside(path: str, final: Optional[str] = None) -> str:
    """Rename a damaged checkpoint to ``<final>.damaged-<id>`` (``final`` defaults to ``path``; kept for
    inspection, never resumed or pruned)."""
    target = f"{final or path}.damaged-{uuid.uuid4().hex[:6]}"
    os.rename(path, target)
    return target


def _interrupted_copies(run_dir: RunDir) -> dict[int, list[str]]:
    """Rank 0: ``{step: complete .tmp- copies, the new write first}`` for each step without a ``step_<N>``."""
    copies: dict[int, list[str]] = {}
    for name in run_dir.existing_checkpoints():
        match = STEP_ANY.match(name)
        if match.group(2) and is_complete(os.path.join(run_dir.checkpoints_dir, name)):
            copies.setdefault(int(match.group(1)), []).append(os.path.join(run_dir.checkpoints_dir, name))
    return {step: sorted(paths, key=lambda p: ".tmp-replaced-" in p) for step, paths in copies.items()
            if not os.path.exists(run_dir.checkpoint_path(step))}


def _restore_or_set_aside(path: str, final: str, problem: Optional[str], warn: Any) -> None:
    """Rank 0: rename a verified copy to ``final``, or set a damaged one aside; one line through ``warn``."""
    say = warn or (lambda message: None)
    try:
        if problem is None:
            os.rename(path, final)
            say(f"checkpoint {final} was complete but not in place (a crash while publishing it); "
                f"restored from {os.path.basename(path)}")
            return
        moved = set_aside(path, final)
    except OSError as err:
        raise UserError(f"cannot restore checkpoint {path}: {err.strerror}") from None
    say(f"checkpoint copy {path} is damaged ({problem}); set aside as {moved}")


def restore_interrupted(run_dir: RunDir, warn: Any = None) -> list[str]:
    """Collective: rename back to ``step_<N>`` each complete checkpoint that a crash left under a ``.tmp-`` name
    (between the renames that publish it, or between its marker and its rename) while no ``step_<N>`` exists;
    returns the restored paths.

    Of two complete copies of a step (the new write and the ``.tmp-replaced-`` copy it was replacing), the new
    one is restored when it verifies, else the other; a copy that fails verification is set aside as
    ``step_<N>.damaged-<id>``. Each is reported in one line through ``warn`` (rank 0); every rank verifies its
    share (:func:`~leangrpo_mcore.engine.ckpt_manifest.verify_on_ranks`) and rank 0 renames.
    """
    restored = []
    for step, paths in sorted(first_error(_interrupted_copies, run_dir).items()):
        final = run_dir.checkpoint_path(step)
        for path in paths:
            problem = manifest.verify_on_ranks(path)
            first_error(_restore_or_set_aside, path, final, problem, warn)
            if problem is None:
                restored.append(final)
                break
    return restored


AUTO = ("auto", FRESH_IF_DAMAGED)
"""The ``checkpoint.resume`` values that pick the newest checkpoint of the run directory."""


def _newest_first(run_dir: RunDir) -> list[str]:
    return [path for _, path in reversed(list_complete(run_dir))]


def _incomplete(run_dir: RunDir, warn: Any) -> list[str]:
    """Rank 0: the ``step_<N>`` directories without a ``COMPLETE`` marker, oldest first, each named in a warning
    (a save never renames one into place unfinished: a copy or a removal by hand that stopped halfway)."""
    found = []
    for name in run_dir.existing_checkpoints():
        match = STEP_DIR.match(name)
        if match and not is_complete(os.path.join(run_dir.checkpoints_dir, name)):
            found.append((int(match.group(1)), os.path.join(run_dir.checkpoints_dir, name)))
    for _, path in sorted(found):
        if warn is not None:
            warn(f"checkpoint {path} has no {MARKER} marker (a copy or a removal that stopped halfway); it is not "
                 f"resumed")
    return [path for _, path in sorted(found)]


def _newest_unverified(run_dir: RunDir, warn: Any) -> Optional[str]:
    """Rank 0: the newest checkpoint with a marker, resumed unverified (``checkpoint.verify: false``), warned."""
    candidates = _newest_first(run_dir)
    if candidates and warn is not None:
        warn(f"checkpoint.resume: {candidates[0]} is resumed without checking it against its {MARKER} marker "
             f"(checkpoint.verify=false)")
    return candidates[0] if candidates else None


def _set_aside_all(damaged: list[tuple[str, str]], warn: Any, then: str) -> None:
    """Rank 0: set each damaged (path, problem) aside, one warning line each ending with ``then``."""
    for path, problem in damaged:
        try:
            moved = set_aside(path)
        except OSError as err:
            raise UserError(f"checkpoint {path} is damaged ({problem}) and cannot be set aside: "
                            f"{err.strerror}") from None
        if warn is not None:
            warn(f"checkpoint {path} is damaged ({problem}); set aside as {moved}, {then}")


def _nothing_verifies(run_dir: RunDir, damaged: list[tuple[str, str]], incomplete: list[str]) -> UserError:
    found = [f"{os.path.basename(path)}: {problem}" for path, problem in damaged]
    found += [f"{os.path.basename(path)}: no {MARKER} marker" for path in incomplete]
    return UserError(f"checkpoint.resume=auto: no checkpoint in {run_dir.checkpoints_dir} verifies ("
                     f"{'; '.join(found)}); nothing was trained. Copy intact checkpoints back, or start afresh on "
                     f"purpose with checkpoint.resume={FRESH_IF_DAMAGED} (the damaged ones are set aside)")


def _resolve_auto(spec: str, run_dir: RunDir, warn: Any, verify: bool) -> Optional[str]:
    """Collective: :func:`resolve_resume` for ``auto`` and ``fresh_if_damaged``."""
    restore_interrupted(run_dir, warn)
    incomplete = first_error(_incomplete, run_dir, warn)
    if not verify:
        return first_error(_newest_unverified, run_dir, warn)
    damaged: list[tuple[str, str]] = []
    for path in first_error(_newest_first, run_dir):
        problem = manifest.verify_on_ranks(path)
        if problem is None:
            first_error(_set_aside_all, damaged, warn, f"resuming from {os.path.basename(path)}")
            return path
        damaged.append((path, problem))
    if not damaged and not incomplete:
        return None
    if spec == "auto":
        raise _nothing_verifies(run_dir, damaged, incomplete)  # every rank has the same lists
    damaged += [(path, f"no {MARKER} marker") for path in incomplete]
    first_error(_set_aside_all, damaged, warn, f"starting afresh (checkpoint.resume={FRESH_IF_DAMAGED})")
    return None


def _check_resume_path(spec: str) -> None:
    if not os.path.isdir(spec):
        raise UserError(f"checkpoint.resume: no such checkpoint directory: {spec}")


def resolve_resume(spec: Optional[str], run_dir: RunDir, warn: Any = None, *, verify: bool = True) -> Optional[str]:
    """Collective: the checkpoint to resume from: None (fresh), ``auto`` (the newest one that verifies, or None),
    ``fresh_if_damaged`` or a path; the same answer (or UserError) on every rank.

    Under ``auto`` complete checkpoints that a crash left under a ``.tmp-`` name are restored first
    (:func:`restore_interrupted`) and ``step_<N>`` directories without a marker are named in a warning; newer
    checkpoints that fail verification are set aside with a one-line ``warn`` (rank 0) each once an older one
    verifies. When none verifies (every checkpoint damaged or incomplete) ``auto`` stops with one line instead of
    starting afresh, and ``fresh_if_damaged`` sets the damaged and incomplete ones aside and starts afresh. An explicit path that
    fails verification is a UserError naming the damaged file. Each rank verifies its share of the bytes
    (:func:`~leangrpo_mcore.engine.checkpoint_verify.verify_before_reading`); rank 0 alone lists and renames.
    ``verify`` False (``checkpoint.verify: false``) skips the verification, with a warning.
    """
    if spec is None:
        return None
    if spec in AUTO:
        return _resolve_auto(spec, run_dir, warn, verify)
    first_error(_check_resume_path, spec)
    verify_before_reading(spec, "checkpoint.resume", enabled=verify, required=True)
    return spec


def read_state(path: str) -> dict:
    """The ``trainer_state.json`` of a complete checkpoint; UserError when it is missing or foreign."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} is unreadable: {STATE_FILE}: {err}") from None
    if state.get("format") != FORMAT or int(state.get("version", -1)) != VERSION:
        raise UserError(f"checkpoint {path} is not a leangrpo_mcore training checkpoint of version {VERSION}")
    return state


def saved_config(path: str) -> Optional[dict]:
    """The resolved config (as a dict) of the run that wrote the checkpoint, or None when unreadable."""
    import yaml

    try:
        with open(os.path.join(path, "config.yaml"), encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def prune(run_dir: RunDir, keep_last: int, newest: Optional[str] = None) -> list[str]:
    """Rank 0: delete all but ``keep_last`` checkpoints (0 keeps all); returns the deleted.

    ``newest`` (the checkpoint just written) is always kept, whatever its step: a run resumed from an older
    checkpoint must not lose its own latest state to checkpoints of the timeline it abandoned.
    """
    if keep_last <= 0:
        return []
    others = [path for _, path in list_complete(run_dir) if path != newest]
    keep = keep_last - (1 if newest is not None else 0)
    doomed = others[:len(others) - keep] if keep > 0 else others
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ------------------------------------------------------------------------------------------------ loading


def rng_state() -> dict:
    """Every generator state of this process: python, numpy, torch CPU and (if present) CUDA."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read checkpoint file {path}: {getattr(err, 'strerror', None) or err}") from None


def _full_shape(target: torch.Tensor, stub: torch.Tensor) -> tuple[int, ...]:
    shape = list(target.shape)
    if getattr(stub, "tensor_model_parallel", False):
        shape[stub.partition_dim] *= tp_world_size()
    return tuple(shape)


def _weight_targets(path: str, metadata: Any, model: torch.nn.Module, ema: Optional[dict[str, torch.Tensor]],
                    layout: TPLayout) -> dict:
    """The flat DCP state dict of the policy's weights and EMA shadows to load into."""
    stored = metadata.state_dict_metadata
    targets: dict[str, Any] = {}
    for name, param in model.named_parameters():
        key, expected = f"model/{name}", _full_shape(param, layout[name])
        if key not in stored:
            missing = sum(f"model/{n}" not in stored for n, _ in model.named_parameters())
            raise UserError(f"checkpoint {path} is incompatible: it lacks '{name}' ({missing} missing)")
        if tuple(stored[key].size) != expected:
            raise UserError(f"checkpoint {path} is incompatible: '{name}' has shape {tuple(stored[key].size)}, "
                            f"this model expects {expected}")
        targets[key] = _blocks(param, layout[name])
    for name, shadow in (ema or {}).items():
        if f"ema/{name}" not in stored:
            raise UserError(f"checkpoint {path} has no EMA of '{name}' but train.ema_decay > 0")
        targets[f"ema/{name}"] = _blocks(shadow, layout[name])
    return targets


def _load_targets(path: str, metadata: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  ema: Optional[dict[str, torch.Tensor]], layout: TPLayout) -> tuple[dict, dict]:
    """(the flat DCP state dict to load into, {parameter: {state key: fresh tensor}} of the optimizer)."""
    stored = metadata.state_dict_metadata
    targets = _weight_targets(path, metadata, model, ema, layout)
    names = _param_names(model)
    fresh: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            prefix = f"optim/{name}/"
            for key in (k for k in stored if k.startswith(prefix)):
                entry = stored[key]
                dtype = entry.properties.dtype
                if len(entry.size) == 0:
                    value = torch.zeros((), dtype=dtype)
                    targets[key] = value
                else:
                    value = torch.zeros_like(p.detach(), dtype=dtype)
                    targets[key] = _blocks(value, layout[name])
                fresh.setdefault(p, {})[key[len(prefix):]] = value
    return targets, fresh


def _apply_schedule_position(lr_scheduler: Any, optimizer: torch.optim.Optimizer, saved: Optional[dict]) -> None:
    """Continue ``lr_scheduler`` (built from this run's config) at the saved position: the config decides the
    learning rates and the schedule, the checkpoint only where in it the run is."""
    if lr_scheduler is None or saved is None:
        return
    lr_scheduler.last_epoch = int(saved["last_epoch"])
    lr_scheduler._step_count = int(saved["step_count"])
    lrs = [base * fn(lr_scheduler.last_epoch) for base, fn in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    lr_scheduler._last_lr = lrs


def _check_groups(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, record: dict) -> None:
    names = _param_names(model)
    saved = record.get("param_groups", [])
    if len(saved) != len(optimizer.param_groups):
        raise UserError(f"checkpoint {path} has {len(saved)} optimizer parameter groups, this run has "
                        f"{len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved):
        mine = [names[id(p)] for p in group["params"]]
        theirs = saved_group.get("param_names") or []
        stage = getattr(model, "stage", None)
        if stage is not None and not stage.is_whole:  # a pipeline stage trains its part, in the saved order
            held = set(mine)
            theirs = [n for n in theirs if n in held] if held <= set(theirs) else theirs
        if mine != theirs:
            differ = sorted(set(mine) ^ set(theirs))[:1] or mine[:1]
            raise UserError(f"checkpoint {path} trains different parameters than this run (e.g. '{differ[0]}')")


def nonfinite_tensor(named: dict[str, torch.Tensor]) -> Optional[str]:
    """Collective: the name of a tensor that holds a NaN or inf on some rank, or None."""
    bad = None
    for name, tensor in named.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            bad = name
            break
    found = [bad]
    if _world() > 1:
        found = [None] * _world()
        dist.all_gather_object(found, bad)
    return next((name for name in found if name), None)


def _metadata(path: str) -> Any:
    try:
        return read_dcp_metadata(Path(path) / DCP_DIR)
    except CheckpointError as err:
        raise UserError(f"checkpoint {path}: {err}") from None


def _read_into(path: str, metadata: Any, targets: dict) -> None:
    """Collective: fill ``targets`` from the checkpoint's DCP files; a failed read is one UserError line naming the
    data file (torch's CheckpointException is a BaseException: a plain ``except Exception`` misses it)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path) / DCP_DIR
    try:
        with quiet_dcp():
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(folder)), planner=BlockLoadPlanner(),
                     no_dist=_world() == 1)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 -- a damaged data file, in one line
        files = data_files(metadata, set(targets))
        where = folder / files[0] if len(files) == 1 else folder
        raise UserError(f"cannot read checkpoint {where}: {dcp_failure(err)}") from None


def _check_finite(path: str, model: torch.nn.Module, ema: Optional[dict[str, torch.Tensor]]) -> None:
    bad = nonfinite_tensor({**dict(model.named_parameters()), **{f"EMA of {k}": v for k, v in (ema or {}).items()}})
    if bad is not None:
        raise UserError(f"checkpoint {path} holds non-finite values in '{bad}'; resume from an earlier checkpoint")


def load_weights(path: str, *, model: torch.nn.Module, ema: Optional[dict[str, torch.Tensor]], layout: TPLayout,
                 warn: Any = None) -> dict:
    """Collective: restore the policy's weights, modules' extra state and EMA only, for an evaluation: no optimizer
    state is read or allocated (AdamW's two moments would hold twice the trained parameters on every rank);
    returns the trainer state."""
    state = read_state(path)
    metadata = _metadata(path)
    targets = _weight_targets(path, metadata, model, ema, layout)
    report = (warn or get_logger().warning) if _rank() == 0 else (lambda message: None)
    extras = extra_state.load_targets(path, model, metadata.state_dict_metadata, tp_rank(), tp_world_size(), report)
    _read_into(path, metadata, {**targets, **extras})
    extra_state.restore(model, extras, path)
    _check_finite(path, model, ema)
    return state


def load_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    ema: Optional[dict[str, torch.Tensor]], layout: TPLayout, same_layout: bool,
                    warn: Any = None) -> dict:
    """Collective: restore model, optimizer state, modules' extra state, LR-schedule position, EMA and (when
    ``same_layout``) RNG states; returns the trainer state. Optimizer hyper-parameters stay those of this run's
    config. ``warn`` (rank 0; the project logger by default) reports extra state the checkpoint lacks."""
    state = read_state(path)
    record = _read_json(os.path.join(path, OPTIM_FILE))
    _check_groups(path, model, optimizer, record)
    metadata = _metadata(path)
    targets, fresh = _load_targets(path, metadata, model, optimizer, ema, layout)
    report = (warn or get_logger().warning) if _rank() == 0 else (lambda message: None)
    extras = extra_state.load_targets(path, model, metadata.state_dict_metadata, tp_rank(), tp_world_size(), report)
    targets.update(extras)
    _read_into(path, metadata, targets)
    extra_state.restore(model, extras, path)
    names = _param_names(model)
    for p, entries in fresh.items():
        entries.update(record.get("scalars", {}).get(names[id(p)], {}))
        optimizer.state[p] = entries
    _apply_schedule_position(lr_scheduler, optimizer, record.get("lr_scheduler"))
    _check_finite(path, model, ema)
    rng_file = os.path.join(path, "rng", f"rank_{_rank()}.pt")
    if same_layout and os.path.isfile(rng_file):
        try:
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        except Exception as err:  # noqa: BLE001 -- truncated or foreign file
            raise UserError(f"cannot read checkpoint file {rng_file}: {exception_line(err, 120)}") from None
    return state
