"""Training checkpoints: atomic, complete-or-absent, reshardable across world size and TP degree.

A checkpoint ``OUTPUT_DIR/checkpoints/step_<N>/`` holds::

    leangrpo_model.json, model.safetensors   the policy in the models package's format (FULL tensors:
                                             TP-gathered, FSDP-unsharded), so leangrpo-convert reads it
    optimizer.pt                             optimizer state per parameter NAME (full tensors) + LR scheduler
    ema.safetensors                          EMA of the trainable parameters (full tensors), when enabled
    rng/rank_<r>.pt                          python, numpy, torch CPU and CUDA generator states of rank r
    trainer_state.json                       step, data sampler position, world/TP layout, counters
    config.yaml                              the resolved config of the run that wrote it
    COMPLETE                                 written last

It is written into ``step_<N>.tmp-<id>``, every file fsynced, the marker written, then the directory renamed, so a
crash mid-save leaves only a ``.tmp-`` directory that resume never picks. Full tensors make resharding trivial:
on load each rank takes its TP slice (:func:`~leangrpo_mcore.models.common.tp.shard_tensor`) and then its FSDP2
shard (sliced on the host, no communication). Storing full tensors costs one gather per save; tensors are
gathered one at a time so no rank holds more than one full parameter besides rank 0's output.

FSDP2 drops the megatron TP attributes of parameters when it wraps them, so the trainer records them first with
:func:`capture_tp_layout` and passes that map to save and load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from leangrpo_mcore.engine.launch import broadcast_object
from leangrpo_mcore.engine.run_dir import STEP_DIR, RunDir
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.checkpoint import CheckpointError, TensorSource, write_policy_checkpoint
from leangrpo_mcore.models.common.tp import gather_tensor, shard_tensor, tp_world_size
from leangrpo_mcore.models.registry import family_for_config

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
OPTIM_FILE = "optimizer.pt"
EMA_FILE = "ema.safetensors"
MODEL_FILE = "model.safetensors"
FORMAT = "leangrpo_mcore.train_checkpoint"
VERSION = 1
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_segments")

TPLayout = dict[str, torch.Tensor]
_UNSHARDED = torch.empty(0, device="meta")
"""Layout stub of a tensor that is already this rank's TP slice."""
WriteModel = Callable[[str, torch.nn.Module, dict[str, torch.Tensor]], None]


def capture_tp_layout(model: torch.nn.Module) -> TPLayout:
    """``{parameter name: meta tensor carrying its TP attributes}``; call before FSDP wraps the model."""
    layout: TPLayout = {}
    for name, tensor in model.named_parameters():
        stub = torch.empty(0, device="meta")
        for attr in _TP_ATTRS:
            if hasattr(tensor, attr):
                setattr(stub, attr, getattr(tensor, attr))
        layout[name] = stub
    return layout


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_full(tensor: torch.Tensor, stub: torch.Tensor) -> torch.Tensor:
    """Collective: the full CPU tensor of a parameter-shaped ``tensor`` (FSDP2-unsharded, then TP-gathered)."""
    local = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return gather_tensor(local.detach(), stub).cpu()


def shard_like(full: torch.Tensor, target: torch.Tensor, stub: torch.Tensor,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """This rank's piece of ``full`` laid out like ``target`` (a plain tensor or an FSDP2 DTensor), in ``dtype``
    (default: the target's), as a fresh copy on the target's device, without communication."""
    local = shard_tensor(full, stub)
    dtype = dtype or target.dtype
    if not isinstance(target, DTensor):
        return local.to(device=target.device, dtype=dtype, copy=True)
    # Slice this rank's block on the host first: only the shard (never the full tensor) reaches the device.
    shape, offset = compute_local_shape_and_global_offset(local.shape, target.device_mesh, target.placements)
    block = local
    for dim, (start, size) in enumerate(zip(offset, shape)):
        block = block.narrow(dim, start, size)
    block = block.to(device=target.device, dtype=dtype, copy=True)
    return DTensor.from_local(block, target.device_mesh, target.placements, run_check=False, shape=local.shape,
                              stride=torch.empty(local.shape, device="meta").stride())


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    dst = target.to_local() if isinstance(target, DTensor) else target
    src = value.to_local() if isinstance(value, DTensor) else value
    if dst.shape != src.shape:
        raise UserError(f"checkpoint tensor has local shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


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


def _full_state(named: Iterator[tuple[str, torch.Tensor]], layout: TPLayout) -> dict[str, torch.Tensor]:
    """Collective over every rank: the full tensors of ``named`` on rank 0 (empty elsewhere)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        full = gather_full(tensor, layout[name])
        if _rank() == 0:
            out[name] = full.contiguous()
    return out


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: TPLayout) -> dict:
    """Collective: the optimizer state keyed by parameter name, parameter-shaped tensors gathered (rank 0)."""
    names = _param_names(model)
    groups, state = [], {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["param_names"] = [names[id(p)] for p in group["params"]]
        groups.append(hyper)
        for p in group["params"]:
            name = names[id(p)]
            entry = {}
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    entry[key] = gather_full(value, layout[name])
                elif isinstance(value, torch.Tensor):
                    entry[key] = value.detach().cpu().clone()
                else:
                    entry[key] = value
            state[name] = entry
    return {"param_groups": groups, "state": state} if _rank() == 0 else {}


def load_optimizer_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict,
                              layout: TPLayout) -> None:
    """Restore :func:`optimizer_full_state` output into ``optimizer`` on this rank's shards."""
    names = _param_names(model)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise UserError(f"checkpoint optimizer has {len(saved['param_groups'])} parameter groups, "
                        f"this run has {len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        mine = [names[id(p)] for p in group["params"]]
        if mine != saved_group["param_names"]:
            missing = sorted(set(mine) ^ set(saved_group["param_names"]))[:1] or mine[:1]
            raise UserError(f"checkpoint optimizer trains different parameters than this run (e.g. '{missing[0]}')")
        group.update({k: v for k, v in saved_group.items() if k != "param_names"})
        for p in group["params"]:
            name = names[id(p)]
            restored = {}
            for key, value in saved["state"].get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    restored[key] = shard_like(value, p, layout[name], value.dtype)
                else:
                    restored[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if restored:
                optimizer.state[p] = restored


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


def list_complete(run_dir: RunDir) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    found = []
    for name in run_dir.existing_checkpoints():
        match = STEP_DIR.match(name)
        path = os.path.join(run_dir.checkpoints_dir, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(spec: Optional[str], run_dir: RunDir) -> Optional[str]:
    """The checkpoint to resume from: None (fresh), ``auto`` (newest complete one, or None), or a path."""
    if spec is None:
        return None
    if spec == "auto":
        complete = list_complete(run_dir)
        return complete[-1][1] if complete else None
    if not os.path.isdir(spec):
        raise UserError(f"checkpoint.resume: no such checkpoint directory: {spec}")
    if not os.path.isfile(os.path.join(spec, MARKER)):
        raise UserError(f"checkpoint.resume: {spec} is not a complete checkpoint (no {MARKER} marker)")
    return spec


def read_state(path: str) -> dict:
    """The ``trainer_state.json`` of a complete checkpoint; UserError when it is missing or foreign."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"checkpoint {path} is unreadable: {STATE_FILE}: {err}") from None
    if state.get("format") != FORMAT or int(state.get("version", -1)) > VERSION:
        raise UserError(f"checkpoint {path} is not a leangrpo_mcore training checkpoint of version <= {VERSION}")
    return state


def save_checkpoint(run_dir: RunDir, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    lr_scheduler: Any, ema: Optional[dict[str, torch.Tensor]], layout: TPLayout,
                    state: dict, config_yaml: str, write_model: Optional[WriteModel] = None) -> str:
    """Collective: write the checkpoint of ``step`` atomically; returns its final path.

    ``state`` is the JSON-able trainer state (step counter, sampler position, layout, counters);
    ``write_model(dst_dir, model, full_parameters)`` writes the policy files on rank 0 (default:
    :func:`write_policy_files`).
    """
    final = run_dir.checkpoint_path(step)
    tmp = broadcast_object(f"{final}.tmp-{uuid.uuid4().hex[:8]}" if _rank() == 0 else None)
    if _rank() == 0:
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    model_state = _full_state(model.named_parameters(), layout)
    if _rank() == 0:
        (write_model or write_policy_files)(tmp, model, model_state)
        del model_state
    optim_state = optimizer_full_state(model, optimizer, layout)
    ema_state = _full_state(iter(sorted(ema.items())), layout) if ema else {}
    if _rank() == 0:
        optim_state["lr_scheduler"] = lr_scheduler.state_dict() if lr_scheduler is not None else None
        torch.save(optim_state, os.path.join(tmp, OPTIM_FILE))
        if ema_state:
            save_file(ema_state, os.path.join(tmp, EMA_FILE))
    rng_path = os.path.join(tmp, "rng", f"rank_{_rank()}.pt")
    torch.save(rng_state(), rng_path)
    _fsync_file(rng_path)
    _barrier()
    if _rank() == 0:
        _finish(tmp, final, step, state, config_yaml)
    _barrier()
    return final


def _finish(tmp: str, final: str, step: int, state: dict, config_yaml: str) -> None:
    for name in os.listdir(tmp):
        if os.path.isfile(os.path.join(tmp, name)):
            _fsync_file(os.path.join(tmp, name))
    with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as fh:
        fh.write(config_yaml)
        fh.flush()
        os.fsync(fh.fileno())
    _write_json(os.path.join(tmp, STATE_FILE), {"format": FORMAT, "version": VERSION, "step": step, **state})
    _write_json(os.path.join(tmp, MARKER), {"step": step})
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


def prune(run_dir: RunDir, keep_last: int) -> list[str]:
    """Rank 0: delete all but the newest ``keep_last`` complete checkpoints (0 keeps all); returns the deleted."""
    if keep_last <= 0:
        return []
    doomed = [path for _, path in list_complete(run_dir)[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def write_policy_files(dst: str, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0: write ``tensors`` (full parameters of ``model``) in the models package's policy format."""
    family = family_for_config(model.config)
    lora = getattr(model, "lora_config", None)
    write_policy_checkpoint(dst, family=family.name, config=model.config.to_diffusers_config(),
                            lora=None if lora is None else lora.to_dict(), tensors=tensors)


def load_model_state(path: str, model: torch.nn.Module, layout: TPLayout) -> None:
    """Load the parameters of ``path``'s policy files into this rank's shards of ``model`` (TP slice read only)."""
    if not os.path.isfile(os.path.join(path, MODEL_FILE)):
        raise UserError(f"checkpoint {path} has no {MODEL_FILE}")
    try:
        source = TensorSource.from_file(Path(path) / MODEL_FILE)
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(source.keys()))
        if missing:
            raise UserError(f"checkpoint {path} is incompatible: it lacks '{missing[0]}' ({len(missing)} missing)")
        for name, param in params.items():
            stub = layout[name]
            expected = _full_shape(param, stub)
            if tuple(source.shape(name)) != expected:
                raise UserError(f"checkpoint {path} is incompatible: '{name}' has shape "
                                f"{tuple(source.shape(name))}, this model expects {expected}")
            _copy_into(param, shard_like(source.get_shard(name, stub), param, _UNSHARDED))
    except CheckpointError as err:
        raise UserError(f"checkpoint {path}: {err}") from None


def _full_shape(target: torch.Tensor, stub: torch.Tensor) -> tuple[int, ...]:
    shape = list(target.shape)
    if getattr(stub, "tensor_model_parallel", False):
        shape[stub.partition_dim] *= tp_world_size()
    return tuple(shape)


def load_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    ema: Optional[dict[str, torch.Tensor]], layout: TPLayout, same_layout: bool) -> dict:
    """Restore model, optimizer, LR scheduler, EMA and (when ``same_layout``) RNG states; returns the trainer state."""
    state = read_state(path)
    load_model_state(path, model, layout)
    saved = torch.load(os.path.join(path, OPTIM_FILE), map_location="cpu", weights_only=True, mmap=True)
    load_optimizer_full_state(model, optimizer, saved, layout)
    if lr_scheduler is not None and saved.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if ema:
        ema_file = os.path.join(path, EMA_FILE)
        if not os.path.isfile(ema_file):
            raise UserError(f"checkpoint {path} has no EMA but train.ema_decay > 0")
        with safe_open(ema_file, framework="pt") as reader:
            for name, shadow in ema.items():
                _copy_into(shadow, shard_like(reader.get_tensor(name), shadow, layout[name]))
    rng_file = os.path.join(path, "rng", f"rank_{_rank()}.pt")
    if same_layout and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    return state
