"""When FSDP2 gathers a step's parameters (pure Python: the planner uses it too).

FSDP2 frees a block's gathered parameters after its forward and backward and gathers them again at the next
use, a collective every data-parallel rank must join in the same order. A step of T denoising steps regathers
every block T times per micro-batch for the rollout alone. Three modes (``parallel.reshard_after_forward``):

- ``forward`` (true): gather for every forward and backward, free after it (least memory);
- ``rollout``: gathered once per prompt group for its rollout, freed before the group's update (the rollout's
  no-grad forwards, and Retain's and Reweight's trained steps inside it, issue no parameter collective);
- ``step`` (false): gathered from the step's first forward to the optimizer step: each block is gathered once
  per update, whatever the steps, micro-batches and groups (the most memory).

Reweight backpropagates each trained step at once, so when ranks train different steps their backwards would
pair one rank's all-gathers with another rank's all-gathers of other blocks: it needs ``rollout`` or ``step``.
"""

from __future__ import annotations

from typing import Any, Union

GATHER_MODES = ("forward", "rollout", "step")
"""The gathering modes, from the least memory to the fewest all-gathers."""

ReshardValue = Union[bool, str, None]
"""A ``parallel.reshard_after_forward`` value: true, false, "rollout", or "auto" / null (unresolved)."""


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


def gather_mode(reshard_after_forward: ReshardValue, *, schedule: str, varies: bool, experts: bool = False) -> str:
    """The gathering mode of ``parallel.reshard_after_forward`` (one of :data:`GATHER_MODES`).

    An unresolved ``auto`` (a run the layout planner did not resolve, e.g. a benchmark that keeps the config's
    layout) gathers per forward, except for Reweight when ranks train different steps, which keeps the step's
    parameters gathered: its immediate backwards would otherwise pair one rank's backward all-gathers with
    another rank's forward all-gathers of other blocks. A two-expert policy (``experts``) whose ranks train
    different steps keeps them gathered under every schedule: one rank's update may run the high-noise expert
    while another's runs the low-noise one, and only gathered units issue no all-gather that would pair them.
    """
    if reshard_after_forward is True:
        return "forward"
    if reshard_after_forward is False:
        return "step"
    if reshard_after_forward == "rollout":
        return "rollout"
    if reshard_after_forward in (None, "auto"):
        return "step" if varies and (schedule == "reweight" or experts) else "forward"
    raise ValueError(f"parallel.reshard_after_forward must be true, false, rollout or auto, got "
                     f"{reshard_after_forward!r}")


def reshard_value(mode: str) -> Any:
    """The ``parallel.reshard_after_forward`` value that selects gathering mode ``mode``."""
    return {"forward": True, "rollout": "rollout", "step": False}[mode]


def keep_parameters_gathered(reshard_after_forward: ReshardValue, *, schedule: str, varies: bool) -> bool:
    """Whether the parameters stay gathered through the rollout (mode ``rollout`` or ``step``)."""
    return gather_mode(reshard_after_forward, schedule=schedule, varies=varies) != "forward"
