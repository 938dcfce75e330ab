"""When FSDP2 keeps a step's parameters gathered (pure Python: the planner uses it too).

FSDP2 frees a block's gathered parameters after its forward and backward and gathers them again at the next
use, a collective every data-parallel rank must join in the same order. Reweight backpropagates each trained
step at once, so when ranks train different steps their backwards would pair one rank's all-gathers with
another rank's all-gathers of other blocks. Kept gathered from the first forward to the optimizer step, a step
issues no parameter collective after the first gather and the ranks need not agree.
"""

from __future__ import annotations


def selection_varies_across_ranks(method: str, *, layout: str, group_size: int, dp_size: int) -> bool:
    """Whether data-parallel ranks can train different rollout steps in the same round.

    ``flow_grpo`` trains the same steps everywhere; ``sde_window`` draws one window per prompt group, so ranks
    agree only when each holds a share of every prompt (shared layout, ``group_size`` a multiple of the ranks);
    ``dance_grpo`` draws per sample. Matters to Reweight, whose backwards run at the trained steps.
    """
    if dp_size <= 1 or method == "flow_grpo":
        return False
    if method == "sde_window":
        return not (layout == "shared" and group_size % dp_size == 0)
    return True


def keep_parameters_gathered(reshard_after_forward: bool | None, *, schedule: str, varies: bool) -> bool:
    """FSDP2 gathering for a step: ``parallel.reshard_after_forward`` resolved (None = auto), negated.

    Auto keeps parameters gathered for Reweight when ranks train different steps: its immediate backwards
    would otherwise pair one rank's backward all-gathers with another rank's forward all-gathers of other
    blocks. Gathered parameters issue no collective until the reduction, so the ranks need not agree.
    """
    if reshard_after_forward is None:
        return schedule == "reweight" and varies
    return not reshard_after_forward
