"""The inputs and the outcome of resolving a config's ``auto`` layout keys at launch (no planner import here).

``parallel.dp_shard``, ``parallel.dp_replicate``, ``parallel.reshard_after_forward``,
``model.activation_checkpointing`` and ``schedule.name`` may say ``auto``; :func:`leangrpo_mcore.engine.build.
resolve_plan` hands them to the layout planner with the live world size and the memory of a rank, and writes its
choice into the config (and so into ``RUN/config.yaml``). Every rank plans from the same inputs (the memory is
the least over the ranks), and the planner is deterministic pure Python, so every rank resolves alike.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from leangrpo_mcore.config.schema import Config
from leangrpo_mcore.engine.launch import DistContext, collective_device

GiB = 1024 ** 3


def auto_keys(config: Config) -> list[str]:
    """The dotted keys of ``config`` that say ``auto`` (``reshard_after_forward: null`` counts as auto)."""
    p = config.parallel
    keys = [key for key, value in (("schedule.name", config.schedule.name), ("parallel.dp_shard", p.dp_shard),
                                   ("parallel.dp_replicate", p.dp_replicate),
                                   ("parallel.reshard_after_forward", p.reshard_after_forward),
                                   ("model.activation_checkpointing", config.model.activation_checkpointing))
            if value == "auto" or value is None]
    return keys


@dataclass(frozen=True)
class PlanningInputs:
    """What the planner is told about the job: the same on every rank."""

    world_size: int
    ranks_per_node: int
    memory_gb: float
    """Memory of one rank the plan may fill, GiB."""
    hardware: str
    """Rate preset: gpu or cpu (``leangrpo_mcore.planner.workload.hardware_preset``)."""
    source: str
    """Where ``memory_gb`` comes from, in words."""

    def plan_flags(self) -> str:
        """The ``leangrpo-plan`` flags that plan with these inputs (after ``--config FILE --schedule config``)."""
        nodes = self.world_size // self.ranks_per_node
        return (f"--hardware {self.hardware} --nodes {nodes} --gpus-per-node {self.ranks_per_node} "
                f"--gpu-mem-gb {self.memory_gb:.2f}")


def ranks_per_node(world_size: int) -> int:
    """Ranks of one node: ``$LOCAL_WORLD_SIZE`` (torchrun), else the whole world (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    count = int(local) if local.isdigit() and int(local) > 0 else world_size
    return count if world_size % count == 0 else world_size


def host_memory_bytes() -> int:
    """Physical memory of this host, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planning_inputs(config: Config, dist_ctx: DistContext) -> PlanningInputs:
    """World size, node shape and the memory of a rank: ``parallel.memory_budget_gb``, else the free memory of a
    GPU (``torch.cuda.mem_get_info``), else the host memory over the ranks of a node; the least over the ranks
    (collective), so that every rank plans the same layout."""
    local = ranks_per_node(dist_ctx.world_size)
    gpu = dist_ctx.device.type == "cuda"
    if config.parallel.memory_budget_gb is not None:
        budget, source = config.parallel.memory_budget_gb * GiB, "parallel.memory_budget_gb"
    elif gpu:
        budget, source = float(torch.cuda.mem_get_info(dist_ctx.device)[0]), "free GPU memory"
    else:
        budget, source = host_memory_bytes() / local, f"host memory / {local} ranks"
    budget = least_over_ranks(budget)
    return PlanningInputs(dist_ctx.world_size, local, round(budget / GiB, 2), "gpu" if gpu else "cpu", source)


def least_over_ranks(value: float) -> float:
    """The smallest ``value`` over every rank (``value`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    # float64 keeps a byte count of a few hundred GiB exact enough for a budget rounded to 0.01 GiB
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return float(tensor.item())


def apply_choice(config: Config, values: dict[str, Any]) -> Config:
    """``config`` with each dotted key of ``values`` that says ``auto`` (or null) set to its value; the
    keys the user fixed are kept."""
    auto = set(auto_keys(config))
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if key in auto:
            section, name = key.split(".")
            sections.setdefault(section, {})[name] = value
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **fields)
                                          for section, fields in sections.items()})


def unplanned(config: Config) -> Config:
    """``config`` for a launch the planner could not plan: checkpointing off where it says auto; the other auto
    keys keep their runtime defaults (FSDP2 over every data-parallel rank, regathered at every forward)."""
    return apply_choice(config, {"model.activation_checkpointing": False})


def describe_inputs(inputs: PlanningInputs) -> str:
    """The planning inputs in words, for the log line."""
    return (f"world size {inputs.world_size} ({inputs.world_size // inputs.ranks_per_node} node(s) x "
            f"{inputs.ranks_per_node}), {inputs.memory_gb:.2f} GiB per rank ({inputs.source}), {inputs.hardware} "
            f"rates")


def chosen_words(overrides: str, reason: str, inputs: PlanningInputs) -> str:
    """The one log line of the choice: the overrides, the inputs and the planner's reason."""
    return f"auto layout: {overrides} for {describe_inputs(inputs)}: {reason}"
