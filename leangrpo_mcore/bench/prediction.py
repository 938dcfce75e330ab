"""The planner's prediction of a benchmarked step, next to the measurement (docs/planning.md, "Time").

For each label the cost model (:mod:`leangrpo_mcore.planner.cost_model`) estimates the step the label runs: its
schedule and variant settings, the arm's data-parallel layout and FSDP2 gathering, activation checkpointing as
configured, on the rates of the device kind (:func:`~leangrpo_mcore.planner.workload.hardware_preset`: ``cpu``
on a CPU, else ``gpu``), with the rollout's forwards at the window starts the timed rounds used. The reward is
not part of the model (``reward_seconds`` 0): the prediction is the policy's passes, communication and optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from leangrpo_mcore.planner.config_workload import rollout_steps_of, workload_from_config
from leangrpo_mcore.planner.cost_model import estimate
from leangrpo_mcore.planner.workload import Hardware, Layout, hardware_preset


def predicted_step(config: Any, schedule: str, layout: Layout, world_size: int, device_type: str,
                   window_starts: list) -> dict:
    """``{"step_time_s": seconds, "terms_s": {term: seconds}, "hardware": kind}`` of one label's step (``config``: the
    label's config on its arm's layout; ``window_starts``: the timed rounds' shared window starts, None where
    none)."""
    kind = "cpu" if device_type == "cpu" else "gpu"
    work = workload_from_config(config)
    starts = [start for start in window_starts if start is not None]
    if starts:
        forwards = [rollout_steps_of(config, start) for start in starts]
        work = dataclasses.replace(work, rollout_steps=sum(forwards) / len(forwards))
    hw = Hardware(nodes=1, gpus_per_node=world_size, **hardware_preset(kind))
    est = estimate(work, hw, layout, schedule, config.model.activation_checkpointing is True)
    if not est.feasible:
        return {"step_time_s": None, "terms_s": {}, "hardware": kind, "note": est.note}
    return {"step_time_s": est.step_time_s, "terms_s": dict(est.time), "hardware": kind,
            "rollout_forwards": work.forwards_per_rollout}
