"""How long a step's policy work takes when the blocks are split over pipeline stages (pure Python).

The runtime (``parallel/stages.py``, ``docs/models.md``) drives the stages three ways, and each has a makespan
in terms of the per-stage seconds of one micro-batch's forward ``f[k]`` and backward ``b[k]`` and the seconds
``h[k]`` a boundary tensor takes from stage k to stage k + 1:

- **forward-only** (a rollout without gradients; megatron-core's forward-only schedule): stage k works on
  micro-batch i while stage k + 1 works on micro-batch i - 1, so m micro-batches take
  ``sum(f) + sum(h) + (m - 1) * (max(f) + max(h))``;
- **1F1B** (Native's recompute; megatron-core's one-forward-one-backward schedule) over u units:
  ``sum(f + b) + 2 sum(h) + (u - 1) * (max(f) + max(b) + 2 max(h))``;
- **backward pipeline** (Retain's deferred backward of its kept graphs, GPipe's second half): the
  forward-only makespan with the backward's seconds, the stages in reverse.

Reweight's trained steps are 1F1B schedules of their own, one per trained denoising step, over the samples of a
group on the rank, and the KL reference forwards of every schedule are forward-only schedules (``cost_model``).
A forward run alone through the stages (lock-step) would cost ``sum(f)`` plus its boundaries, each stage idle
while the others compute; the trainer avoids it.

What a stage computes itself is the step's ordinary compute (the cost model's ``rollout``, ``recompute``,
``backward``, ... of its own layers); the rest of a makespan is boundary traffic (``p2p``) and waiting (the
``pipeline bubble``). Transfers are counted as exposed, like every other communication in the cost model.
"""

from __future__ import annotations

from typing import Sequence

from leangrpo_mcore.planner.workload import Hardware, Layout


def crossing_boundaries(hw: Hardware, layout: Layout) -> list[bool]:
    """Whether each of the ``pp - 1`` stage boundaries joins two nodes (pp outermost: stage k is ranks
    k x stage_ranks onwards)."""
    return [hw.nodes > 1 and (k * layout.stage_ranks) % hw.gpus_per_node == 0 for k in range(1, layout.pp)]


def boundary_seconds(hw: Hardware, layout: Layout, nbytes: float) -> list[float]:
    """Seconds ``nbytes`` take across each stage boundary: over the inter-node links where consecutive stages
    sit on different nodes, else inside a node."""
    return [nbytes / ((hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9)
            for crosses in crossing_boundaries(hw, layout)]


def forward_only(forward: Sequence[float], hops: Sequence[float], micro_batches: int) -> tuple[float, float]:
    """(makespan, boundary seconds on its critical path) of ``micro_batches`` forwards through the stages."""
    if micro_batches < 1:
        return 0.0, 0.0
    widest_hop = max(hops, default=0.0)
    p2p = sum(hops) + (micro_batches - 1) * widest_hop
    return sum(forward) + (micro_batches - 1) * max(forward) + p2p, p2p


def one_f_one_b(forward: Sequence[float], backward: Sequence[float], hops: Sequence[float],
                units: int) -> tuple[float, float]:
    """(makespan, boundary seconds on its critical path) of ``units`` forward-backward units under 1F1B."""
    if units < 1:
        return 0.0, 0.0
    widest_hop = max(hops, default=0.0)
    p2p = 2 * sum(hops) + (units - 1) * 2 * widest_hop
    span = sum(forward) + sum(backward) + (units - 1) * (max(forward) + max(backward)) + p2p
    return span, p2p
