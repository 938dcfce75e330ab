"""Where every rank sits in a plan: node, TP and CP rank, FSDP/HSDP coordinates, worker group and generations.

Global rank = node x gpus_per_node + local rank. Pipeline stages are outermost: stage k is the ``stage_ranks``
ranks from k x stage_ranks, each with the data-parallel layout below over its own ranks. Tensor parallelism
varies fastest, then context parallelism
(megatron-core's order, ``parallel/mesh.py``), so a TP group is ``tp`` consecutive local ranks and a CP group
``cp`` ranks ``tp`` apart among ``tp x cp`` consecutive ones, never leaving a node (the planner only picks
TP x CP dividing the GPUs per node). The data-parallel index is ``rank // (tp x cp)``; the CP ranks of an index
make the same generations. FSDP shards over ``dp_shard`` consecutive data-parallel indices (x CP; inside a node
by construction) and HSDP replicates across the rest (a (replicate, shard)
device mesh). Prompt groups follow ``leangrpo_mcore.parallel.groups``: with M >= R generations every rank holds
every prompt and makes generations q·R + r; with M < R, worker groups of M consecutive data-parallel indices
each take one prompt at a time, so a group's reward all-gather stays inside one node whenever M·tp fits in it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from leangrpo_mcore.planner.workload import Hardware, Layout, Shape


@dataclass(frozen=True)
class RankPlacement:
    """One row of the rank table."""

    rank: int
    node: int
    local_rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    dp_shard: int
    dp_replicate: int
    worker_group: int
    generations: tuple[int, ...]
    """Generation indices (within each prompt group) this rank makes."""
    prompt_slots: tuple[int, ...]
    """Prompt groups of the step (0 .. prompts_per_step - 1) this rank works on."""
    pp_rank: int = 0
    """Pipeline stage (the blocks it holds: ``block_split.stage_block_counts``)."""


@dataclass(frozen=True)
class Placement:
    """The rank table and the locality facts the planner promises."""

    ranks: tuple[RankPlacement, ...]
    tp_groups_intra_node: bool
    fsdp_groups_intra_node: bool
    group_gather_intra_node: bool
    """Every prompt group's reward all-gather stays inside one node."""
    group_gather_nodes: int
    """Nodes one prompt group's all-gather spans (1 when intra-node)."""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        out = asdict(self)
        out["ranks"] = [{**row, "generations": list(row["generations"]), "prompt_slots": list(row["prompt_slots"])}
                        for row in out["ranks"]]
        return out


def place(layout: Layout, hw: Hardware, shape: Shape, group_size: int, prompts_per_step: int,
          conventional: bool = False) -> Placement:
    """The rank table of ``layout`` on ``hw`` for groups of ``group_size`` (see the module doc)."""
    g, tp, cp, dp = hw.gpus_per_node, layout.tp, layout.cp, layout.dp
    rows = []
    for rank in range(hw.world_size):
        node, local = divmod(rank, g)
        stage, inner = divmod(rank, layout.stage_ranks)
        dp_rank = inner // (tp * cp)
        if conventional:
            worker, gens = dp_rank, tuple(range(group_size))
            slots = tuple(range(dp_rank, prompts_per_step, dp))
        else:
            worker, member = divmod(dp_rank, shape.ranks_per_group)
            gens = tuple(range(member, group_size, shape.ranks_per_group))
            slots = tuple(range(worker, prompts_per_step, shape.worker_groups))
        rows.append(RankPlacement(rank, node, local, rank % tp, (rank // tp) % cp, dp_rank,
                                  dp_rank % layout.dp_shard, dp_rank // layout.dp_shard, worker, gens, slots, stage))
    nodes_per_group = {}
    for row in rows:  # a group's reward all-gather runs among its ranks of one stage
        nodes_per_group.setdefault((row.pp_rank, row.worker_group), set()).add(row.node)
    spans = max(len(nodes) for nodes in nodes_per_group.values())
    return Placement(
        ranks=tuple(rows),
        tp_groups_intra_node=g % tp == 0,
        fsdp_groups_intra_node=g % (tp * cp * layout.dp_shard) == 0,
        group_gather_intra_node=spans == 1,
        group_gather_nodes=spans,
    )
