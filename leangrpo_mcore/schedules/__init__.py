"""Update schedules behind one interface, chosen by ``schedule.name``: native, retain, reweight."""

from leangrpo_mcore.schedules.base import (
    SCHEDULES,
    GroupUpdate,
    Objective,
    Schedule,
    ScheduleContext,
    UpdateStats,
    available_schedules,
    build_schedule,
    loss_weight,
    register_schedule,
    unit_loss,
)
from leangrpo_mcore.schedules.native import NativeSchedule
from leangrpo_mcore.schedules.retain import RetainSchedule
from leangrpo_mcore.schedules.reweight import ReweightPlan, ReweightSchedule, max_abs_advantage, plan_reweight

__all__ = [
    "SCHEDULES", "GroupUpdate", "NativeSchedule", "Objective", "RetainSchedule", "ReweightPlan", "ReweightSchedule",
    "Schedule", "ScheduleContext", "UpdateStats", "available_schedules", "build_schedule", "loss_weight",
    "max_abs_advantage", "plan_reweight", "register_schedule", "unit_loss",
]
