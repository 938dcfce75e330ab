"""The step engine: one training step of one policy with one schedule (rollout → reward → advantages → update →
sync → clip → optimizer).

    plan.py         StepPlan: the resolved settings of a step, validated for exactness
    records.py      StepInputs, StepResult, UpdateResult, the reward_fn and progress callbacks, group records
    engine.py       StepEngine: the step, its advantages and its update blocks (grpo.updates_per_rollout)
    rollout.py      a prompt group's rollout, micro-batch by micro-batch or through pipeline stages
    reward_join.py  scoring once per sample, gathering a group's rewards, joining background scoring

The names below are the package's interface; the modules' other names are theirs.
"""

from leangrpo_mcore.engine.step.engine import StepEngine
from leangrpo_mcore.engine.step.plan import StepPlan
from leangrpo_mcore.engine.step.records import ProgressFn, RewardFn, StepInputs, StepResult, UpdateResult

__all__ = ["ProgressFn", "RewardFn", "StepEngine", "StepInputs", "StepPlan", "StepResult", "UpdateResult"]
