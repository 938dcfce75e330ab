"""The passes a step runs on a rank: policy forwards and backwards per sample, gradient synchronisations (pure Python).

What the step engine does (``engine/step/``), counted: a rollout runs T' policy forwards per sample (T, or fewer
when the steps after a shared SDE window are compressed: :attr:`Workload.rollout_steps`); ``updates_per_rollout = K``
splits the step's prompt groups into K blocks, the first trained by the configured schedule, the later ones by
Native after the optimizer steps before them, so each sample is trained once, by its block's schedule.
"""

from __future__ import annotations

from leangrpo_mcore.planner.workload import Shape, Workload


def reweight_parts(work: Workload, pp: int) -> int:
    """Forward-backward units per trained sample and step of Reweight: two at pp > 1 with the KL term (its KL part
    and its policy-gradient part, each with its own forward: ``schedules/reweight.py``), else one."""
    return 2 if pp > 1 and work.kl_beta > 0 else 1


def coalesced(work: Workload, schedule: str) -> bool:
    """Whether ``schedule`` accumulates unsharded gradients and syncs later (``engine.step`` sync modes)."""
    return schedule != "native" or work.coalesce_sync


def sample_passes(work: Workload, schedule: str, pp: int = 1) -> tuple[float, float]:
    """(forwards, backwards) of one sample trained by ``schedule``: its T' rollout forwards, Native's recompute of
    each of its |S| trained steps, a KL reference forward per trained step, Reweight's second forward of the KL part
    at ``pp`` > 1; one backward per trained step, and Reweight's separate KL backward."""
    steps, kl = work.selected_steps, work.kl_beta > 0
    again = reweight_parts(work, pp) - 1 if schedule == "reweight" else 0
    forwards = work.forwards_per_rollout + steps * ((1 if schedule == "native" else 0) + (1 if kl else 0) + again)
    backwards = steps * (1 + (1 if kl and schedule == "reweight" else 0))
    return forwards, backwards


def step_passes(work: Workload, schedule: str, pp: int = 1) -> tuple[float, float]:
    """(forwards, backwards) per sample of a step, averaged over its update blocks (the first ``schedule``'s, the
    K − 1 later ones Native's)."""
    own = sample_passes(work, schedule, pp)
    if work.updates_per_rollout == 1:
        return own
    native, first = sample_passes(work, "native", pp), work.first_block
    return tuple(first * a + (1 - first) * b for a, b in zip(own, native))


def sync_count(work: Workload, shape: Shape, schedule: str) -> float:
    """Gradient synchronisations per step on a rank: Reweight one reduce-scatter per group of its block, Retain and
    coalesced Native one per update, Native one per backward; the later blocks (Native) sync as the configured
    schedule's mode says (coalesced, unless Native per backward)."""
    if schedule == "reweight":
        return shape.groups_per_rank * work.first_block + (work.updates_per_rollout - 1)
    if coalesced(work, schedule):
        return float(work.updates_per_rollout)
    return float(shape.micro_batches * work.selected_steps)  # every backward, in every block
