"""Which SDE-window settings can work together (docs/algorithms.md §8): checked when the config loads, before
any heavy work, and again by the step engine that places the window (:mod:`leangrpo_mcore.diffusion.window`)."""

from __future__ import annotations

from typing import Optional, Union

WINDOW_SCHEDULES = ("fixed", "random", "progressive")
BEFORE_WINDOW_SOLVERS = ("same", "euler")


def is_ratio(after: Union[int, float, None]) -> bool:
    """Whether ``sampler.ode_steps_after_window`` is a ratio of the remaining steps (a float in (0, 1)) rather than a
    count."""
    return isinstance(after, float) and 0.0 < after < 1.0


def ratio_tail_steps(num_steps: int, window_end: int, ratio: float) -> Optional[int]:
    """MixGRPO-Flash's ODE steps after a window ending at ``window_end`` for a ``ratio`` of the remainder
    (docs/algorithms.md §8): P = int(max((T − e + 1)·r, 1)) points, the count its sampling code computes from its last
    SDE step e − 1, so P − 1 steps, at least one; None when that leaves every step of the remainder (or there is
    none)."""
    remaining = num_steps - window_end
    if remaining < 1:
        return None
    # the float product and int() truncation of MixGRPO-Flash's own count
    steps = max(int(max((num_steps - (window_end - 1)) * ratio, 1)) - 1, 1)
    return None if steps >= remaining else steps


def rollout_steps(num_steps: int, window_end: int, after: Union[int, float, None]) -> int:
    """T', the denoising steps (policy forwards) of a rollout whose shared window ends at ``window_end`` with
    ``sampler.ode_steps_after_window = after`` (a count, a ratio, or 0 / None: no compression)."""
    remaining = num_steps - window_end
    if not after or remaining < 1:
        return num_steps
    tail = ratio_tail_steps(num_steps, window_end, float(after)) if is_ratio(after) else int(after)
    return num_steps if tail is None or tail >= remaining else window_end + tail


def window_error(*, size: int, low: int, high: int, schedule: str, stride: int, shift_every: int,
                 ode_steps_after: Union[int, float, None], ode_solver: str, num_steps: int,
                 ode_solver_before: str = "same") -> Optional[str]:
    """The one-line reason the window settings cannot work, naming the key, or None."""
    if schedule not in WINDOW_SCHEDULES:
        return f"sampler.sde_window_schedule={schedule!r}; valid: {', '.join(WINDOW_SCHEDULES)}"
    if stride < 1 or shift_every < 1:
        key, value = ("sampler.window_stride", stride) if stride < 1 else ("sampler.window_shift_every", shift_every)
        return f"{key}={value}: the progressive window needs a value >= 1"
    if ode_steps_after is not None and (ode_steps_after < 0 or (isinstance(ode_steps_after, float)
                                                                 and not is_ratio(ode_steps_after)
                                                                 and not float(ode_steps_after).is_integer())):
        return (f"sampler.ode_steps_after_window={ode_steps_after}: needs a count >= 0 or a ratio in (0, 1) of the "
                f"remaining steps (0 or null: no compression)")
    if ode_solver_before not in BEFORE_WINDOW_SOLVERS:
        return f"sampler.ode_solver_before_window={ode_solver_before!r}; valid: {', '.join(BEFORE_WINDOW_SOLVERS)}"
    if size == 0:
        for key, value, default in (("sampler.sde_window_schedule", schedule, "random"),
                                    ("sampler.ode_solver", ode_solver, "euler"),
                                    ("sampler.ode_solver_before_window", ode_solver_before, "same"),
                                    ("sampler.ode_steps_after_window", ode_steps_after or 0, 0)):
            if value != default:
                return (f"{key}={value} needs an SDE window (sampler.sde_window_size >= 1): without one every "
                        f"step is an SDE step")
        return None
    if not 0 <= low < high or low + size > num_steps:
        return (f"sampler.sde_window_range={[low, high]}: the window of {size} steps must start in [low, high) "
                f"with 0 <= low < high and fit the {num_steps} steps")
    if ode_steps_after and schedule == "random":
        return ("sampler.ode_steps_after_window needs a shared window (sampler.sde_window_schedule=fixed or "
                "progressive): a random window per prompt group would give the groups different step counts")
    return None
