"""Loading a training checkpoint at this run's layout: model, optimizer state, EMA, modules' extra state, the
LR-schedule position and (at the same layout) the RNG states (:func:`load_checkpoint`, to resume), or the weights,
modules' extra state and EMA alone (:func:`load_weights`, to evaluate).

Each rank reads the boxes of the FULL tensors it needs at its own layout, which is what makes a checkpoint load at
any world size, FSDP2/HSDP degree and TP degree. FSDP2 drops the megatron TP attributes of parameters when it wraps
them, so the trainer records them first with :func:`~leangrpo_mcore.models.common.tp.capture_tp_layout` and passes
that map here and to the save.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.engine.checkpoint import extra_state
from leangrpo_mcore.engine.checkpoint.format import OPTIM_FILE, rank, read_json, read_state, world
from leangrpo_mcore.engine.checkpoint.state import blocks, param_names, set_rng_state
from leangrpo_mcore.engine.launch import get_logger
from leangrpo_mcore.errors import UserError, exception_line
from leangrpo_mcore.models.common.checkpoint import DCP_DIR, CheckpointError
from leangrpo_mcore.models.common.dcp_blocks import BlockLoadPlanner, quiet_dcp
from leangrpo_mcore.models.common.dcp_source import data_files, dcp_failure, read_dcp_metadata
from leangrpo_mcore.models.common.tp import TPLayout, tp_rank, tp_world_size


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
        targets[key] = blocks(param, layout[name])
    for name, shadow in (ema or {}).items():
        if f"ema/{name}" not in stored:
            raise UserError(f"checkpoint {path} has no EMA of '{name}' but train.ema_decay > 0")
        targets[f"ema/{name}"] = blocks(shadow, layout[name])
    return targets


def _load_targets(path: str, metadata: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  ema: Optional[dict[str, torch.Tensor]], layout: TPLayout) -> tuple[dict, dict]:
    """(the flat DCP state dict to load into, {parameter: {state key: fresh tensor}} of the optimizer)."""
    stored = metadata.state_dict_metadata
    targets = _weight_targets(path, metadata, model, ema, layout)
    names = param_names(model)
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
                    targets[key] = blocks(value, layout[name])
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
    names = param_names(model)
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
    if world() > 1:
        found = [None] * world()
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
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(path) / DCP_DIR
    try:
        with quiet_dcp():
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(folder)), planner=BlockLoadPlanner(),
                     no_dist=world() == 1)
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
    report = (warn or get_logger().warning) if rank() == 0 else (lambda message: None)
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
    record = read_json(os.path.join(path, OPTIM_FILE))
    _check_groups(path, model, optimizer, record)
    metadata = _metadata(path)
    targets, fresh = _load_targets(path, metadata, model, optimizer, ema, layout)
    report = (warn or get_logger().warning) if rank() == 0 else (lambda message: None)
    extras = extra_state.load_targets(path, model, metadata.state_dict_metadata, tp_rank(), tp_world_size(), report)
    targets.update(extras)
    _read_into(path, metadata, targets)
    extra_state.restore(model, extras, path)
    names = param_names(model)
    for p, entries in fresh.items():
        entries.update(record.get("scalars", {}).get(names[id(p)], {}))
        optimizer.state[p] = entries
    _apply_schedule_position(lr_scheduler, optimizer, record.get("lr_scheduler"))
    _check_finite(path, model, ema)
    rng_file = os.path.join(path, "rng", f"rank_{rank()}.pt")
    if same_layout and os.path.isfile(rng_file):
        try:
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        except Exception as err:  # noqa: BLE001 -- truncated or foreign file
            raise UserError(f"cannot read checkpoint file {rng_file}: {exception_line(err, 120)}") from None
    return state
