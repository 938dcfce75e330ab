"""How a pipeline splits a policy's blocks over its stages (no torch: the planner reads it too).

The policies' stages (:func:`leangrpo_mcore.models.common.pipeline.split_blocks`) and the planner's per-stage
memory and time (:mod:`leangrpo_mcore.planner.arch_specs`) take the even split from :func:`stage_block_counts`,
so what the planner predicts for a stage is what the trainer builds.
"""

from __future__ import annotations


def stage_block_counts(total: int, pp: int) -> list[int]:
    """Blocks of each of ``pp`` pipeline stages in the even split of ``total`` blocks: the remainder goes to the
    first stages. ValueError when a stage would get no block."""
    if pp < 1:
        raise ValueError(f"pipeline-parallel size must be at least 1, got {pp}")
    if pp > total:
        raise ValueError(f"cannot split {total} blocks over {pp} pipeline stages: every stage needs a block")
    return [total // pp + (1 if rank < total % pp else 0) for rank in range(pp)]
