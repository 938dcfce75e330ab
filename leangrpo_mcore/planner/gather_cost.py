"""What FSDP2's gathering mode costs a step: gathered parameters held per phase, all-gathers issued (pure Python).

The modes are the engine's (:mod:`leangrpo_mcore.parallel.gathering`): ``forward`` regathers each block for
every forward and backward (two blocks and the root gathered at a time: FSDP2 prefetches the next block),
``rollout`` keeps every block gathered through each prompt group's rollout and regathers in its update, ``step``
keeps every block gathered from the step's first forward to the optimizer step. A "gather" below is one
all-gather of every FSDP unit of the rank's model (its pipeline stage): ``(s - 1) / s`` of its parameters
arrive over the data-parallel links, the unsharded copy is written once (FSDP2 copies out of the all-gather
buffer even over a one-rank shard group), and each unit's collective pays the launch latency.
"""

from __future__ import annotations

from leangrpo_mcore.parallel.gathering import GATHER_MODES, gather_mode, selection_varies_across_ranks
from leangrpo_mcore.planner.arch_specs import ArchSpec, largest_block_params, params_per_rank, stored_params_per_rank
from leangrpo_mcore.planner.passes import sample_passes
from leangrpo_mcore.planner.workload import Hardware, Layout, Shape, Workload

__all__ = ["GATHER_MODES", "mode_of", "gathered_elements", "full_gathers", "gather_seconds", "refused_mode"]


def mode_of(work: Workload, layout: Layout, schedule: str) -> str:
    """The gathering mode ``work`` runs ``schedule`` with on ``layout`` (an unresolved ``auto``: the engine's
    fallback, :func:`~leangrpo_mcore.parallel.gathering.gather_mode`)."""
    return gather_mode(work.reshard_after_forward, schedule=schedule, varies=_varies(work, layout),
                       experts=work.arch.experts > 1)


def _varies(work: Workload, layout: Layout) -> bool:
    return selection_varies_across_ranks(work.selection, layout=work.layout, group_size=work.group_size,
                                         dp_size=layout.dp)


def refused_mode(work: Workload, layout: Layout, schedule: str, mode: str) -> str:
    """Why the engine refuses ``mode`` for ``schedule`` on ``layout`` ('' when it runs it)."""
    if mode == "forward" and schedule == "reweight" and layout.dp_shard > 1 and _varies(work, layout):
        return (f"Reweight with {work.selection} selection trains different steps on different ranks: its "
                f"immediate backwards cannot regather FSDP2 blocks in step")
    if work.arch.experts > 1 and layout.dp > 1 and _varies(work, layout):
        # the engine's rule (engine/step.py): ranks may run different experts in one update
        why = f"two experts with {work.selection} selection: the ranks may run different experts in an update"
        if mode != "step" and not (schedule == "reweight" and mode == "rollout"):
            return f"{why}, so the units must stay gathered for the step"
        if schedule == "native" and not work.coalesce_sync:
            return f"{why}, so Native must coalesce its gradient sync (schedule.coalesce_sync)"
        if work.updates_per_rollout > 1:
            return f"{why}, so a later update's recompute cannot regather them (grpo.updates_per_rollout 1)"
    return ""


def gathered_elements(arch: ArchSpec, layout: Layout, mode: str) -> tuple[int, int]:
    """(during a rollout, during an update) gathered parameter elements per rank of ``arch`` (0 without FSDP); a
    forward gathers one expert's units, a rollout passes through every expert."""
    if not layout.fsdp:
        return 0, 0
    root = sum(lin.params for lin in arch.root)
    everything = stored_params_per_rank(arch, layout.tp)
    few = min(2 * largest_block_params(arch, layout.tp) + root, everything)
    return (few if mode == "forward" else everything), (everything if mode == "step" else few)


def full_gathers(work: Workload, shape: Shape, schedule: str, mode: str, pp: int = 1) -> float:
    """All-gathers of the whole model per rank and step (the passes of :mod:`leangrpo_mcore.planner.passes`).

    ``forward``: one per micro-batch pass (Reweight runs each trained sample alone: one per sample pass there).
    ``step``: one per update (the optimizer step frees the gathered copies). ``rollout``: one per prompt group's
    rollout, plus the update's passes (Native's recompute and backward, Retain's deferred backward, the KL
    reference forwards; Reweight's trained passes run inside its rollout). The groups of the later update blocks
    are Native's.
    """
    mb, n, steps = shape.micro_batches, shape.samples, work.selected_steps
    rollout, share, experts = work.forwards_per_rollout, work.first_block, work.arch.experts
    # counted in gathers of one expert: a pass runs one, a step's or rollout's gathering covers them all
    if mode == "step":
        return float(work.updates_per_rollout * experts)
    native = sample_passes(work, "native", pp)
    own = sample_passes(work, schedule, pp)
    if mode == "forward":
        if schedule != "reweight":
            return mb * (share * sum(own) + (1 - share) * sum(native))
        alone = own[0] - rollout + steps  # the per-sample passes gather once per sample
        return share * (mb * (own[0] - alone) + n * (alone + own[1])) + (1 - share) * mb * sum(native)
    later = (1 - share) * mb * (native[0] - rollout + native[1])
    if schedule == "reweight":
        return shape.groups_per_rank * experts + later
    return shape.groups_per_rank * experts + share * mb * (own[0] - rollout + own[1]) + later


def gather_seconds(work: Workload, hw: Hardware, layout: Layout, arch: ArchSpec) -> float:
    """Seconds of one all-gather of every FSDP unit of ``arch`` (one expert's) on a rank (0 without FSDP)."""
    if not layout.fsdp:
        return 0.0
    data = params_per_rank(arch, layout.tp) * work.precision.compute_bytes
    s = layout.shard_ranks
    seconds = data / (hw.hbm_gbps * 1e9)  # the unsharded copy written out of the all-gather buffer
    if s > 1:
        units = sum(block.count for block in arch.blocks) + 1  # a unit per block, and the root
        seconds += (s - 1) / s * data / (hw.intra_node_gbps * 1e9) + units * hw.collective_latency_s
    return seconds
