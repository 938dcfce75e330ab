"""FSDP2 wrapping of a policy: ``fully_shard`` per block, then the root (torchtitan's order).

The mesh is the data-parallel mesh of :mod:`leangrpo_mcore.parallel.mesh`: (dp_shard,) for FSDP or
(dp_replicate, dp_shard) for HSDP. megatron's own FSDP is never used (it does not run on CPU).

Gradient reduction is a plain SUM (``set_gradient_divide_factor(1.0)`` with sum-only collectives): the
loss is normalised once over every sample and step of the whole update
(:func:`leangrpo_mcore.schedules.base.loss_weight`), so the data-parallel reduction must add, never average.

FSDP2 replaces each parameter by a sharded DTensor parameter; megatron's tensor-parallel attributes
(``tensor_model_parallel``, ``partition_dim``, ...) are copied onto the new parameters so that gradient
clipping can still tell partitioned from replicated weights.
"""

from __future__ import annotations

import torch

from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.parallel.precision import mixed_precision_policy

_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _tp_attributes(model: torch.nn.Module) -> dict[str, dict]:
    saved = {}
    for name, param in model.named_parameters():
        attrs = {a: getattr(param, a) for a in _TP_ATTRIBUTES if hasattr(param, a)}
        if attrs:
            saved[name] = attrs
    return saved


def _owned_output(module: torch.nn.Module, args, output):
    """A unit's output as a tensor of its own: a copy when it is a view (a 3-D linear's result is one).

    FSDP2 hooks its pre-backward gather on the output of each unit (a forward hook, which this one precedes);
    an in-place op on a view would drop that hook, and torch warns about every view it is handed. The copy is
    exact and costs one output-sized tensor, and a policy's output is the small velocity."""
    if isinstance(output, torch.Tensor) and output._base is not None:
        return output.clone()
    return None


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every FSDP2-managed module inside ``model`` (the root included), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 root."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def apply_fsdp(
    model: torch.nn.Module,
    ctx: ParallelContext,
    *,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    cast_only: bool = False,
) -> torch.nn.Module:
    """Shard ``model`` in place over ``ctx.dp_mesh`` and return it; a no-op without data parallelism, except
    with ``cast_only`` in a one-process world: FSDP2 over a one-rank mesh then only casts the master weights to
    ``param_dtype`` for the forwards (and the gradients back), as it does at any data-parallel degree.

    ``model.blocks()`` gives the transformer blocks (each its own FSDP unit); a model with ``fsdp_groups()``
    (two experts: each expert's embedders and head) gets a unit for each of those next; the remaining parameters
    (embedders, final layer) form the root unit.

    The step engine sets the resharding of each step with :class:`StepGathering`.
    """
    mesh = ctx.dp_mesh
    if mesh is None and cast_only and ctx.world_size == 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("dp_shard",))
    if mesh is None:
        return model
    from torch.distributed.fsdp import fully_shard

    if not hasattr(model, "blocks"):
        raise ValueError(f"{type(model).__name__} has no blocks(): cannot wrap it per block")
    saved = _tp_attributes(model)
    mp_policy = mixed_precision_policy(param_dtype, reduce_dtype)
    groups = model.fsdp_groups() if hasattr(model, "fsdp_groups") else []
    for unit in [*model.blocks(), *groups]:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
        module.register_forward_hook(_owned_output, prepend=True)
    for name, param in model.named_parameters():
        for attr, value in saved.get(name, {}).items():
            setattr(param, attr, value)
    return model


def set_gathered(model: torch.nn.Module, gathered: bool) -> None:
    """Keep every FSDP2 unit's parameters gathered from its first forward until :func:`reshard_policy`
    (``gathered``), or free them after each forward and backward (FSDP2's ``reshard_after_forward``).

    Gathered, a step issues no parameter collective after the first gather of each unit: the repeated
    all-gathers are saved (at the cost of the full parameters in memory), and ranks whose trained steps differ
    can run their immediate backwards (Reweight) without meeting at every unit's gather.
    """
    for module in fsdp_modules(model):
        module.set_reshard_after_forward(not gathered, recurse=False)
        module.set_reshard_after_backward(not gathered, recurse=False)


def reshard_policy(model: torch.nn.Module) -> None:
    """Free every gathered FSDP2 unit of ``model`` (a no-op for sharded units and plain modules).

    Needed before the optimizer steps when parameters stay gathered (``reshard_after_forward=False``): the
    optimizer updates the shards, so a gathered copy would be stale at the next forward.
    """
    for module in fsdp_modules(model):
        module.reshard()


class StepGathering:
    """The gathering mode of one step (:mod:`leangrpo_mcore.parallel.gathering`) applied to a policy's FSDP2 units.

    The engine calls :meth:`rollout` before each prompt group's rollout and :meth:`update` before the gradient
    work that follows it. ``forward`` regathers at every use, ``step`` keeps everything gathered until the
    optimizer step (:func:`reshard_policy`), ``rollout`` keeps the units gathered through a rollout and frees
    them before the update, whose passes regather.
    """

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        from leangrpo_mcore.parallel.gathering import GATHER_MODES

        if mode not in GATHER_MODES:
            raise ValueError(f"unknown gathering mode {mode!r}; valid: {', '.join(GATHER_MODES)}")
        self.model, self.mode = model, mode
        self.gathered = mode != "forward"
        reshard_policy(model)  # a forward outside the engine (samples, probes) may have left units gathered
        set_gathered(model, self.gathered)

    def rollout(self) -> None:
        """A prompt group's rollout starts: under ``rollout`` its first forward gathers each unit for all of it."""
        if self.mode == "rollout" and not self.gathered:
            set_gathered(self.model, True)
            self.gathered = True

    def update(self) -> None:
        """A group's update starts: under ``rollout`` the gathered units are freed, so its passes regather."""
        if self.mode == "rollout" and self.gathered:
            reshard_policy(self.model)
            set_gathered(self.model, False)
            self.gathered = False
