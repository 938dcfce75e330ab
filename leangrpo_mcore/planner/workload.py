"""What the planner plans: the cluster, the experiment, a parallel layout and how a step's samples fall on it.

Pure Python dataclasses shared by :mod:`leangrpo_mcore.planner.cost_model` and
:mod:`leangrpo_mcore.planner.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import ArchSpec

GiB = 1024 ** 3
SCHEDULES = ("native", "retain", "reweight")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor, and the matmul speed-up over the quoted GPU rate."""

    name: str
    storage_bytes: int
    """Sharded trainable weights (the master weights)."""
    compute_bytes: int
    """Gathered weights, activations and frozen (LoRA base / KL reference) weights."""
    grad_bytes: int
    """Sharded gradients."""
    buffer_bytes: int
    """Unsharded gradients: Reweight's provisional buffers and the reduce-scatter payload."""
    matmul_speedup: float = 1.0


# bf16: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over fp32 master weights, as in the
# paper's runs (its provisional gradients are bf16). fp8: TE FP8 GEMMs at twice the bf16 rate; activations are
# budgeted at bf16 (conservative: TE keeps some linear inputs in fp8).
PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 4, 4),
    "bf16": Precision("bf16", 4, 2, 4, 2),
    "fp8": Precision("fp8", 4, 2, 4, 2, matmul_speedup=2.0),
}


@dataclass(frozen=True)
class Hardware:
    """The cluster: shape, memory, speeds."""

    nodes: int
    gpus_per_node: int
    gpu_mem_bytes: Optional[int] = None
    """Usable memory per GPU (None: unlimited, only time decides)."""
    gpu_tflops: float = 312.0
    """Dense bf16 TFLOP/s per GPU (A100: 312, H100 SXM: 989, RTX A6000: 155)."""
    efficiency: float = 0.4
    """Fraction of the peak rate the policy's kernels reach."""
    intra_node_gbps: float = 150.0
    """Collective bus bandwidth per GPU inside a node, GB/s."""
    inter_node_gbps: float = 25.0
    """Collective bus bandwidth per GPU across nodes, GB/s."""
    hbm_gbps: float = 1500.0
    """GPU memory bandwidth, GB/s (gradient-buffer and optimizer traffic)."""
    overhead_bytes: int = int(1.5 * GiB)
    """Per-GPU memory outside tensors: CUDA context, NCCL buffers, allocator fragmentation."""
    reduce_scatter_gbps: Optional[float] = None
    """Reduce-scatter bus bandwidth per GPU inside a node, GB/s (None: ``intra_node_gbps``; gloo's
    reduce-scatter is several times slower than its all-reduce)."""
    collective_latency_s: float = 2e-5
    """Launch latency of one collective, s (FSDP2 issues one per unit and gather or reduction)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise UserError(f"need nodes >= 1 and gpus per node >= 1, got {self.nodes} and {self.gpus_per_node}")
        rates = (self.gpu_tflops, self.efficiency, self.intra_node_gbps, self.inter_node_gbps, self.hbm_gbps)
        if min(rates) <= 0 or self.efficiency > 1:
            raise UserError("GPU TFLOP/s, bandwidths and efficiency must be positive (efficiency at most 1)")
        if (self.reduce_scatter_gbps is not None and self.reduce_scatter_gbps <= 0) or self.collective_latency_s < 0:
            raise UserError("the reduce-scatter bandwidth must be positive and the collective latency >= 0")
        if self.gpu_mem_bytes is not None and self.gpu_mem_bytes <= 0:
            raise UserError(f"GPU memory must be positive, got {self.gpu_mem_bytes} bytes")

    @property
    def world_size(self) -> int:
        """GPUs in the cluster."""
        return self.nodes * self.gpus_per_node

    @property
    def reduce_scatter_rate(self) -> float:
        """Reduce-scatter bus bandwidth inside a node, GB/s."""
        return self.reduce_scatter_gbps or self.intra_node_gbps


CPU_HOST = {"gpu_tflops": 0.06, "efficiency": 0.7, "intra_node_gbps": 0.5, "inter_node_gbps": 0.1,
            "reduce_scatter_gbps": 0.17, "hbm_gbps": 5.0, "overhead_bytes": GiB, "collective_latency_s": 5e-4}
"""Rates of a CPU host whose ranks are single-threaded processes joined by gloo (``leangrpo-plan --hardware
cpu``, the trainer's ``auto`` keys on CPU and the CPU benchmark's predictions): a core's fp32 matmul rate (60
GFLOP/s: one thread of the 2-core AMD EPYC benchmark machine on the policies' matmul shapes) of which the policy's
forwards and backwards reach 0.7 with a rank on each core (a single rank alone runs about 0.9 of it: the
benchmark's world-size-1 steps take some 15 % less than predicted), gloo's all-gather / all-reduce and (slower)
reduce-scatter bandwidths and its per-collective latency. (An earlier preset of 25 GFLOP/s at 0.5, measured on a
loaded machine, predicted the CPU benchmark's steps three times too long.)"""

HARDWARE_KINDS = ("gpu", "cpu")
"""Rate presets: ``gpu`` (the :class:`Hardware` defaults, an A100-class GPU) and ``cpu`` (:data:`CPU_HOST`)."""


def hardware_preset(kind: str) -> dict:
    """The :class:`Hardware` rates of a kind of device (``gpu``: the defaults)."""
    if kind not in HARDWARE_KINDS:
        raise UserError(f"unknown hardware kind {kind!r}; valid: {', '.join(HARDWARE_KINDS)}")
    return dict(CPU_HOST) if kind == "cpu" else {}


@dataclass(frozen=True)
class Workload:
    """One experiment as the planner sees it."""

    arch: ArchSpec
    tokens: dict
    """Tokens per sample of each stream (:meth:`ArchSpec.tokens`)."""
    num_steps: int
    selected_steps: int
    group_size: int
    prompts_per_step: int
    micro_batch: int = 1
    lora_rank: int = 0
    lora_targets: tuple = ()
    precision: Precision = PRECISIONS["bf16"]
    activation_checkpointing: Optional[bool] = None
    """None: the planner tries both."""
    kl_beta: float = 0.0
    cfg: bool = False
    """Two-branch classifier-free guidance: every forward runs a batch of two."""
    updates_per_rollout: int = 1
    reward_seconds: float = 0.0
    """Reward time per generation (decode + reward model), on the rank that made it."""
    reward_mem_bytes: int = 0
    """Memory reserved per GPU for the reward model (always resident)."""
    decode_bytes: int = 0
    """Transient memory of decoding and scoring one micro-batch (VAE decode + reward forward)."""
    reward_model_bytes: int = 0
    """The learned reward model, resident on the scoring ranks only (CP rank 0 of the last pipeline stage)."""
    reward_activation_bytes: int = 0
    """Its inference activations of one scoring batch, on the scoring ranks while they score."""
    reward_model: str = ""
    """The reward model's name, for the plan's words ('' when the reward holds none)."""
    foreach_optimizer: bool = True
    """The optimizer updates all parameters at once (torch's default on CUDA: one parameter-sized temporary);
    False: one parameter at a time (torch's default on CPU)."""
    optimizer: str = "adamw"
    momentum: float = 0.0
    reshard_after_forward: Union[bool, str, None] = None
    """FSDP2 gathering (parallel.reshard_after_forward): true, false or "rollout" fix it; "auto": the planner
    tries every mode (:func:`~leangrpo_mcore.planner.layout.plan`); None: the step engine's fallback for an
    unresolved auto (:func:`~leangrpo_mcore.parallel.gathering.gather_mode`)."""
    selection: str = "flow_grpo"
    """grpo.timestep_selection (whether ranks train different steps)."""
    reweight_accumulate: str = "per_sample"
    global_std: bool = False
    """grpo.global_std: advantages need every reward of the step (Retain keeps every group's graphs until then)."""
    reweight_global_fold: bool = False
    """Reweight folds each group and scales once at the end (the clamp cannot fire); otherwise, with global std,
    it keeps every local provisional gradient of the step until the last reward."""
    coalesce_sync: bool = False
    layout: str = "shared"
    reweight_note: str = ""
    """Why Reweight's accumulation fell back from ``affine`` (empty when it did not)."""
    async_scoring: bool = False
    """reward.async_scoring (the trainer refuses it with context parallelism, so the planner offers no cp > 1)."""
    experts_train: str = "both"
    """model.experts.train of a two-expert policy: both, high or low (``selected_steps`` then counts only the
    trained expert's steps)."""
    rollout_steps: Optional[float] = None
    """T', the policy forwards of a rollout when the steps after a shared SDE window are compressed (MixGRPO-Flash),
    averaged over the window's starts; None: ``num_steps``."""
    keep_means: bool = False
    """grpo.ratio_norm: a trajectory also keeps every step's SDE mean (float32, one latent per step)."""

    def __post_init__(self) -> None:
        if min(self.num_steps, self.selected_steps, self.group_size, self.prompts_per_step, self.micro_batch) < 1:
            raise UserError("steps, selected steps, group size, prompts per step and micro-batch must be >= 1")
        if self.selected_steps > self.num_steps:
            raise UserError(f"selected steps ({self.selected_steps}) exceed the steps ({self.num_steps})")
        if self.updates_per_rollout < 1 or self.lora_rank < 0 or self.kl_beta < 0 or self.reward_seconds < 0:
            raise UserError("updates per rollout >= 1, LoRA rank >= 0, KL beta >= 0 and reward time >= 0 needed")
        if self.experts_train != "both" and self.arch.experts == 1:
            raise UserError(f"experts train {self.experts_train}: {self.arch.name} has one transformer")
        if self.rollout_steps is not None and not self.selected_steps <= self.rollout_steps <= self.num_steps:
            raise UserError(f"rollout forwards ({self.rollout_steps}) must lie between the selected steps "
                            f"({self.selected_steps}) and the steps ({self.num_steps})")

    @property
    def forwards_per_rollout(self) -> float:
        """T' (:attr:`rollout_steps`), else T."""
        return float(self.num_steps if self.rollout_steps is None else self.rollout_steps)

    @property
    def first_block(self) -> float:
        """The share of a step's prompt groups the configured schedule trains: the first of ``updates_per_rollout``
        blocks (the later ones are Native's, ``engine/step/engine.py``)."""
        return 1.0 / self.updates_per_rollout

    @property
    def full_finetune(self) -> bool:
        """True without LoRA adapters."""
        return self.lora_rank == 0

    @property
    def trained_experts(self) -> int:
        """Experts of the policy that learn (the others are frozen: no gradients, no optimizer state)."""
        return self.arch.experts if self.experts_train == "both" else 1


@dataclass(frozen=True)
class Layout:
    """Parallel degrees: TP and CP inside a node, FSDP sharding inside a node, HSDP replicas across the rest of a
    pipeline stage, and ``pp`` stages outermost.

    World size = pp x tp x cp x dp_shard x dp_replicate (``parallel/mesh.py``). The cp ranks of a data-parallel
    index split every sample's tokens and make the same samples; FSDP2 shards over dp_shard x cp of them. Each
    pipeline stage has this data-parallel layout over its own ``stage_ranks`` ranks; the pp ranks of a sample
    count as one data-parallel rank.
    """

    tp: int
    dp_shard: int
    dp_replicate: int
    cp: int = 1
    pp: int = 1

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (the whole world at pp = 1)."""
        return self.tp * self.cp * self.dp_shard * self.dp_replicate

    @property
    def world_size(self) -> int:
        """Ranks of the layout."""
        return self.pp * self.stage_ranks

    @property
    def dp(self) -> int:
        """Data-parallel ranks R (the CP ranks of a sample count once)."""
        return self.dp_shard * self.dp_replicate

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP2 shards parameters, gradients and optimizer state over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        """True when FSDP2 wraps the policy (more than one rank outside the TP group)."""
        return self.dp * self.cp > 1


@dataclass(frozen=True)
class Shape:
    """How one step's samples fall on a rank for a layout (LeanGRPO §4.1)."""

    generations_per_rank: int
    """Q: generations of one prompt on one rank."""
    worker_groups: int
    """P: groups of ranks working on different prompts at once."""
    ranks_per_group: int
    groups_per_rank: int
    """Prompt groups one rank takes part in per step."""
    micro_batch: int
    micro_batches: int
    """Forward batches per rank per step."""
    idle_fraction: float = 0.0

    @property
    def samples(self) -> int:
        """Generations made on one rank per step."""
        return self.groups_per_rank * self.generations_per_rank


def sample_shape(work: Workload, layout: Layout) -> Shape:
    """Q, P and the per-rank work of ``layout``; UserError when the group cannot be spread evenly."""
    r, m, prompts = layout.dp, work.group_size, work.prompts_per_step
    if work.layout == "conventional":
        q, p, per_group, groups = m, r, 1, -(-prompts // r)
    elif m >= r:
        if m % r:
            raise UserError(f"group size {m} does not split over {r} data-parallel ranks")
        q, p, per_group, groups = m // r, 1, r, prompts
    else:
        if r % m:
            raise UserError(f"{r} data-parallel ranks do not split into worker groups of {m}")
        q, p, per_group, groups = 1, r // m, m, -(-prompts // (r // m))
    b = min(work.micro_batch, q)
    idle = 1.0 - prompts / (groups * p)
    return Shape(q, p, per_group, groups, b, groups * -(-q // b), idle)
