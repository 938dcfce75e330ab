"""One layout description → megatron tensor-parallel groups + a torch DeviceMesh for data parallelism.

Rank order follows megatron-core's default ``tp-cp-ep-dp-pp``: tensor parallelism varies fastest, then context
parallelism, then data parallelism, and pipeline parallelism is outermost, so the global ranks form a
(pp, dp_replicate, dp_shard, cp, tp) grid in row-major order: a CP group of cp·tp consecutive ranks stays inside
a node whenever cp·tp divides the GPUs per node, and with pp = nodes each pipeline stage is one node. Every
pipeline stage has the same data-parallel layout over its own ranks (its own FSDP2 mesh, its own
data-parallel group); the pp ranks of a sample count as one data-parallel rank. The data-parallel
ranks (rewards, prompt groups, statistics) are the ranks sharing this rank's CP and TP ranks. FSDP2 shards over
dp_shard·cp ranks: the CP ranks of a sample hold the same parameters and their partial gradients add up like
those of any data-parallel rank, so the FSDP mesh is (dp_replicate, dp_shard·cp) with ``dp_shard`` naming that
flattened dimension. :func:`build_parallel_context` asserts these groups against ``parallel_state``.

Every group made here (megatron's, the mesh's) and by :func:`~leangrpo_mcore.parallel.groups.build_group_process_groups`
gets the default group's timeout (``parallel.timeout_minutes``, :func:`default_group_timeout`): torch's
``new_group`` and ``init_device_mesh`` would otherwise give each subgroup torch's own 30 minutes, so a rank
stalled in a data-parallel or tensor-parallel collective would hang for that long whatever the key says.

Without ``torch.distributed`` (a plain single process) the context is trivial: TP = DP = 1, no mesh, and
the models' TP helpers fall back to identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist

Degree = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Layout:
    """Parallel degrees; ``auto`` data-parallel degrees are resolved from the live world size."""

    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    cp: int = 1
    """Context (sequence) parallel degree."""
    dp_replicate: Degree = "auto"
    """HSDP replica degree (auto = 1)."""
    dp_shard: Degree = "auto"
    """FSDP sharding degree over data-parallel ranks (auto = world / (tp · cp · dp_replicate))."""

    def resolve(self, world_size: int) -> "Layout":
        """The layout with integer degrees whose product is ``world_size``; ValueError otherwise."""
        model = self.tp * self.cp * self.pp
        if self.tp < 1 or self.cp < 1 or self.pp < 1 or world_size % model:
            degrees = (f"tp={self.tp}" + (f" x cp={self.cp}" if self.cp != 1 else "")
                       + (f" x pp={self.pp}" if self.pp != 1 else ""))
            raise ValueError(f"{degrees} does not divide the world size {world_size}")
        replicate = 1 if self.dp_replicate == "auto" else int(self.dp_replicate)
        if replicate < 1 or (world_size // model) % replicate:
            raise ValueError(f"dp_replicate={replicate} does not divide world/(tp*cp*pp) = {world_size // model}")
        shard = world_size // (model * replicate) if self.dp_shard == "auto" else int(self.dp_shard)
        if shard < 1 or model * replicate * shard != world_size:
            raise ValueError(f"tp ({self.tp}) x cp ({self.cp}) x pp ({self.pp}) x dp_replicate ({replicate}) x "
                             f"dp_shard ({shard}) != world size {world_size}")
        return Layout(tp=self.tp, pp=self.pp, cp=self.cp, dp_replicate=replicate, dp_shard=shard)

    @classmethod
    def from_config(cls, parallel) -> "Layout":
        """From a :class:`~leangrpo_mcore.config.schema.ParallelConfig`."""
        return cls(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, dp_replicate=parallel.dp_replicate,
                   dp_shard=parallel.dp_shard)


@dataclass
class ParallelContext:
    """The live parallel state of this process."""

    layout: Layout
    """Resolved degrees."""
    world_size: int = 1
    """Total processes."""
    rank: int = 0
    """Global rank."""
    tp_rank: int = 0
    """Rank inside the tensor-parallel group."""
    cp_rank: int = 0
    """Rank inside the context-parallel group."""
    pp_rank: int = 0
    """Pipeline stage of this rank (0 = first)."""
    dp_rank: int = 0
    """Index among the data-parallel ranks (replicate-major, shard-minor)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Compute device."""
    dp_mesh: object | None = None
    """FSDP2 DeviceMesh (dp_shard,) or (dp_replicate, dp_shard), its dp_shard dimension spanning dp_shard · cp
    ranks; None when that mesh has one rank."""
    dp_group: object | None = None
    """Process group of all data-parallel ranks of this (CP, TP) position (None at DP = 1)."""
    tp_group: object | None = None
    """Megatron's tensor-parallel group (None at TP = 1 without distributed)."""
    cp_group: object | None = None
    """Megatron's context-parallel group (None at CP = 1)."""
    pp_group: object | None = None
    """Megatron's pipeline-parallel group: the stages of this rank's samples (None at PP = 1)."""
    dp_global_ranks: list[list[int]] = field(default_factory=lambda: [[0]])
    """For each (CP rank, TP rank) position of this rank's pipeline stage, the global ranks of its data-parallel
    group in DP order."""
    all_dp_global_ranks: list[list[int]] = field(default_factory=lambda: [[0]])
    """The same for every pipeline stage, stage after stage (what a collective ``new_group`` over the
    data-parallel groups needs on every rank)."""
    group_timeout: Optional[timedelta] = None
    """The timeout every group of this context was created with (None without torch.distributed)."""

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (dp_replicate · dp_shard); the CP ranks of a sample count once."""
        return int(self.layout.dp_replicate) * int(self.layout.dp_shard)

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks of FSDP2's sharding dimension (dp_shard · cp)."""
        return int(self.layout.dp_shard) * self.layout.cp

    def dp_shard_group(self):
        """The reduce-scatter group (None when there is no DP sharding mesh)."""
        if self.dp_mesh is None:
            return None
        return self.dp_mesh.get_group("dp_shard")

    def dp_replicate_group(self):
        """The HSDP all-reduce group (None without replication)."""
        if self.dp_mesh is None or int(self.layout.dp_replicate) == 1:
            return None
        return self.dp_mesh.get_group("dp_replicate")


def default_group_timeout() -> timedelta:
    """The timeout of the default process group (what :func:`~leangrpo_mcore.engine.launch.init_distributed`
    set from ``parallel.timeout_minutes``, or a test harness chose)."""
    group = dist.group.WORLD
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    # torch keeps a group's timeout only in its backend's options (no public getter): listed in
    # parallel/mcore_internals.py.
    options = group._get_backend(device).options
    if options is None:  # a backend without options (the simulator's fake one): torch's default
        return dist.constants.default_pg_timeout
    return options._timeout


def mesh_backend_options(timeout: timedelta, ndim: int) -> Optional[dict[int, tuple[str, object]]]:
    """``init_device_mesh``'s ``backend_override`` giving each of ``ndim`` mesh dimensions ``timeout``.

    ``init_device_mesh`` has no timeout argument; it passes the options' timeout to the groups it creates.
    """
    backend = dist.get_backend()
    if backend not in ("nccl", "gloo"):  # the simulator's fake backend takes no timeout
        return None
    options_cls = dist.ProcessGroupNCCL.Options if backend == "nccl" else dist.ProcessGroupGloo._Options
    override = {}
    for dim in range(ndim):
        options = options_cls()
        options._timeout = timeout
        override[dim] = (backend, options)
    return override


def _init_megatron(tp: int, cp: int, pp: int, timeout: timedelta) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != tp
                or parallel_state.get_context_parallel_world_size() != cp
                or parallel_state.get_pipeline_model_parallel_world_size() != pp):
            raise ValueError(f"megatron parallel_state is already initialised with other TP/CP/PP sizes than "
                             f"{tp}/{cp}/{pp}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp,
                                             distributed_timeout_minutes=timeout.total_seconds() / 60.0)


def _check_against_megatron(ctx: ParallelContext, mesh) -> None:
    from megatron.core import parallel_state

    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    mesh_tp = mesh["tp"].mesh.flatten().tolist()
    dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    mesh_dp = mesh["dp_replicate", "dp_shard"].mesh.flatten().tolist()
    if tp_ranks != mesh_tp or dp_ranks != mesh_dp:
        raise RuntimeError(
            f"device mesh and megatron disagree: TP {mesh_tp} vs {tp_ranks}, DP x CP {mesh_dp} vs {dp_ranks}"
        )
    pure_dp = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    if pure_dp != ctx.dp_global_ranks[ctx.cp_rank * ctx.layout.tp + ctx.tp_rank]:
        raise RuntimeError(f"megatron's data-parallel group {pure_dp} differs from the layout's")
    if (parallel_state.get_tensor_model_parallel_rank() != ctx.tp_rank
            or parallel_state.get_context_parallel_rank() != ctx.cp_rank
            or parallel_state.get_pipeline_model_parallel_rank() != ctx.pp_rank):
        raise RuntimeError("megatron's TP, CP or PP rank differs from the mesh's")


def build_parallel_context(layout: Layout, device: torch.device | str = "cpu",
                           timeout: Optional[timedelta] = None) -> ParallelContext:
    """Resolve ``layout``, initialise megatron's TP groups and build the data-parallel DeviceMesh, every group
    with ``timeout`` (default: the default group's, :func:`default_group_timeout`)."""
    device = torch.device(device)
    if not dist.is_available() or not dist.is_initialized():
        resolved = layout.resolve(1)
        return ParallelContext(layout=resolved, device=device)
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    resolved = layout.resolve(world)
    replicate, shard, tp, cp, pp = (int(resolved.dp_replicate), int(resolved.dp_shard), resolved.tp, resolved.cp,
                                    resolved.pp)
    timeout = timeout if timeout is not None else default_group_timeout()
    _init_megatron(tp, cp, pp, timeout)
    mesh = init_device_mesh(device.type, (pp, replicate, shard * cp, tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
                            backend_override=mesh_backend_options(timeout, 4))
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
    per_stage = world // pp
    stage = rank // per_stage
    grid = torch.arange(world).reshape(pp, -1, cp, tp)
    every = [[grid[s, :, c, t].tolist() for c in range(cp) for t in range(tp)] for s in range(pp)]
    columns = every[stage]
    ctx = ParallelContext(
        layout=resolved, world_size=world, rank=rank, tp_rank=rank % tp, cp_rank=(rank // tp) % cp,
        pp_rank=stage, dp_rank=(rank % per_stage) // (tp * cp), device=device,
        dp_mesh=dp_mesh if replicate * shard * cp > 1 else None, dp_group=None, tp_group=None,
        dp_global_ranks=columns, all_dp_global_ranks=[column for columns_of in every for column in columns_of],
        group_timeout=timeout,
    )
    from megatron.core import parallel_state

    ctx.tp_group = parallel_state.get_tensor_model_parallel_group()
    ctx.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
    ctx.pp_group = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None
    ctx.dp_group = parallel_state.get_data_parallel_group() if replicate * shard > 1 else None
    _check_against_megatron(ctx, mesh)
    return ctx


def destroy_parallel_context() -> None:
    """Tear down megatron's groups (the default process group stays)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
