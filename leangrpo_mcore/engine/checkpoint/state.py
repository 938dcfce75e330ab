"""A rank's training state as a DCP state dict (model, optimizer, EMA as boxes of the FULL tensor), the optimizer's
non-tensor record, and every generator state of the process.

Nothing is gathered: a rank's shards go to disk as they are (see :mod:`~leangrpo_mcore.models.common.dcp_blocks`
for how a TP slice's FSDP2 shard becomes boxes of the FULL tensor), so the host memory of a save is at most one
rank's shards, and on load each rank reads the boxes it needs at its own layout.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from leangrpo_mcore.engine.checkpoint import extra_state
from leangrpo_mcore.engine.checkpoint.format import world
from leangrpo_mcore.models.common.dcp_blocks import Block, BlockTensor, block_tensor
from leangrpo_mcore.models.common.tp import TPLayout, tp_rank, tp_world_size


def param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def blocks(tensor: torch.Tensor, stub: torch.Tensor) -> BlockTensor:
    return block_tensor(tensor, stub, tp_rank(), tp_world_size())


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > 0 and tuple(value.shape) == tuple(param.shape)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   ema: Optional[dict[str, torch.Tensor]], layout: TPLayout) -> tuple[dict, dict]:
    """(the flat DCP state dict of this rank's shards, the JSON-able non-tensor optimizer state)."""
    state: dict[str, Any] = {f"model/{name}": blocks(p, layout[name]) for name, p in model.named_parameters()}
    names, scalars = param_names(model), {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if _is_param_shaped(value, p):
                    state[f"optim/{name}/{key}"] = blocks(value, layout[name])
                elif isinstance(value, torch.Tensor) and value.ndim == 0:
                    state[f"optim/{name}/{key}"] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = value
    for name, shadow in sorted((ema or {}).items()):
        state[f"ema/{name}"] = blocks(shadow, layout[name])
    state.update(extra_state.save_entries(model, tp_rank()))
    return state, scalars


def optimizer_record(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                      scalars: dict) -> dict:
    names = param_names(model)
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        hyper["param_names"] = [names[id(p)] for p in group["params"]]
        groups.append(hyper)
    sched = None
    if lr_scheduler is not None:
        sched = {"last_epoch": int(lr_scheduler.last_epoch), "step_count": int(lr_scheduler._step_count)}
    return {"param_groups": groups, "scalars": scalars, "lr_scheduler": sched}


def merged_record(record: dict) -> dict:
    """Collective: the optimizer record of the whole model. Pipeline stages hold different parameters; their
    names are joined in rank order (stage after stage: the whole model's order), each group's scalars merged."""
    if world() == 1:
        return record
    records: list = [None] * world()
    dist.all_gather_object(records, record)
    merged = records[0]
    for other in records[1:]:
        for group, theirs in zip(merged["param_groups"], other["param_groups"]):
            known = set(group["param_names"])
            group["param_names"].extend(n for n in theirs["param_names"] if n not in known)
        for name, values in other["scalars"].items():
            merged["scalars"].setdefault(name, values)
    return merged


def host_copy(state: dict) -> dict:
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
