"""The layout planner and the step simulator: everything that predicts a training step without running it.

Architecture specs (:mod:`.arch_specs`), workloads (:mod:`.workload`, :mod:`.config_workload`), the memory and
time models (:mod:`.cost_model`, :mod:`.activations` with its fit, :mod:`.pipeline_time`, :mod:`.placement`,
:mod:`.reward_specs`), the search over layouts (:mod:`.layout`) and the fake-tensor simulator
(:mod:`.simulate`, :mod:`.sim_mode`, :mod:`.simulate_plan`). See ``docs/planning.md``.

The planner imports the runtime (``parallel``, ``engine``, ``models``); the runtime reaches the planner only
through :func:`plan_for_config`, which ``schedule.name: auto`` calls to pick the schedule and the data-parallel
degrees, and :func:`step_flops_for_config`, the FLOP count behind the per-step throughput metrics. Everything here but the simulator is pure Python (no torch).
"""

from leangrpo_mcore.planner.flops import step_flops_for_config
from leangrpo_mcore.planner.layout import plan_for_config

__all__ = ["plan_for_config", "step_flops_for_config"]
