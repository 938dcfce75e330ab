"""Sigma schedules of the flow-matching samplers (docs/algorithms.md §3).

Every schedule is a 1-D float32 tensor of ``num_steps + 1`` sigmas that starts at 1 (pure noise) and
decreases to a final sigma of exactly 0 (the clean sample). Step ``t`` of a trajectory maps the latent at
``sigmas[t]`` to the latent at ``sigmas[t + 1]``.

Values are computed in float64 and rounded once to float32, except where the reference computes in
float32 itself (noted per schedule): matching the reference's own rounding keeps the derived integer
timesteps identical.

Timestep convention (what the policy's forward receives):
``timesteps_from_sigmas`` returns the scheduler-scale timestep in [0, 1000], exactly the values a diffusers
pipeline iterates over (``scheduler.timesteps``) or, for DanceGRPO, ``int(sigma * 1000)``. SD3 and Wan
pipelines hand that value to their transformer unchanged. FluxPipeline (and DanceGRPO's FLUX script)
hand ``timestep / 1000`` to ``FluxTransformer2DModel``, which multiplies by 1000 again inside, and so does
QwenImagePipeline; ``transformer_timestep(timesteps, "flux", dtype=latent_dtype)`` reproduces that cast and
division, so a FLUX or Qwen-Image policy sees the same number as the diffusers transformer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SIGMA_KINDS = ("flux", "sd3", "dance", "wan", "qwen_image")
TRANSFORMER_FAMILIES = ("flux", "sd3", "wan", "qwen_image")
_DYNAMIC_KINDS = ("flux", "qwen_image")
"""Schedules whose shift depends on the packed latent token count."""

_NUM_TRAIN_TIMESTEPS = 1000
_DEFAULT_SHIFT = {"sd3": 3.0, "dance": 3.0, "wan": 3.0}


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")


def _check_shift(shift: float) -> None:
    if not (isinstance(shift, (int, float)) and math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a positive finite number, got {shift!r}")


def _append_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


def static_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 / DanceGRPO time shift ``s·t / (1 + (s − 1)·t)`` applied elementwise (dtype preserved)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_mu(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX dynamic-shift exponent: the line through (base_seq_len, base_shift), (max_seq_len, max_shift)."""
    if max_seq_len == base_seq_len:
        raise ValueError("max_seq_len must differ from base_seq_len")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def flux_sigmas(
    num_steps: int,
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> torch.Tensor:
    """FlowGRPO-FLUX schedule: linspace(1, 1/N, N), exponential shift with mu(image_seq_len), then 0.

    ``image_seq_len`` is the packed latent token count ((H/16)·(W/16) for FLUX). Matches FluxPipeline +
    ``FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)``; returns (N+1,) float32, last 0.
    """
    _check_num_steps(num_steps)
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
        raise ValueError(f"image_seq_len must be a positive int, got {image_seq_len!r}")
    mu = flux_mu(
        image_seq_len,
        base_seq_len=base_seq_len,
        max_seq_len=max_seq_len,
        base_shift=base_shift,
        max_shift=max_shift,
    )
    # diffusers rounds the linspace to float32 and shifts in float32 (with exp(mu) rounded to float32);
    # the same operations here give its schedule bit for bit.
    t = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).to(torch.float32)
    exp_mu = torch.tensor(math.exp(mu), dtype=torch.float32)
    one = torch.ones((), dtype=torch.float32)
    return _append_zero(exp_mu / (exp_mu + (one / t - one)))


QWEN_IMAGE_SHIFT = {"base_seq_len": 256, "max_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9}
"""The dynamic shift of Qwen/Qwen-Image's scheduler/scheduler_config.json (QwenImagePipeline's
``calculate_shift`` reads these; its own defaults, FLUX's 4096 and 1.15, apply only to a scheduler without them)."""
QWEN_IMAGE_SHIFT_TERMINAL = 0.02
"""Qwen-Image's scheduler stretches the shifted schedule so that its last nonzero sigma is 0.02."""


def qwen_image_sigmas(num_steps: int, image_seq_len: int, *,
                      shift_terminal: float = QWEN_IMAGE_SHIFT_TERMINAL) -> torch.Tensor:
    """Qwen-Image schedule: FLUX's (linspace(1, 1/N, N), exponential shift with mu(image_seq_len) on the release's
    line :data:`QWEN_IMAGE_SHIFT`), then stretched so that the last nonzero sigma is ``shift_terminal``
    (``1 - (1 - s) / ((1 - s_N) / (1 - shift_terminal))``), then 0.

    Matches QwenImagePipeline + the released ``FlowMatchEulerDiscreteScheduler`` config in float32 (the stretch
    runs in float32 there too); returns (N+1,) float32, last 0.
    """
    if not 0.0 < shift_terminal < 1.0:
        raise ValueError(f"shift_terminal must lie in (0, 1), got {shift_terminal!r}")
    _check_num_steps(num_steps)
    if num_steps < 2:  # one step has sigma 1 alone: nothing to stretch (diffusers divides 0 by 0)
        raise ValueError("the qwen_image schedule needs at least 2 steps")
    shifted = flux_sigmas(num_steps, image_seq_len, **QWEN_IMAGE_SHIFT)[:-1]
    one_minus = 1 - shifted
    scale = one_minus[-1] / (1 - shift_terminal)
    return _append_zero(1 - one_minus / scale)


def _flow_match_default_sigmas(num_steps: int, shift: float, num_train_timesteps: int) -> torch.Tensor:
    """Sigmas of ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)`` without the 0."""
    # The scheduler's smallest training sigma is shift(1/num_train_timesteps), stored in float32; the
    # inference linspace runs from 1 down to it and is then shifted a second time (diffusers behaviour).
    sigma_min = static_shift(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32), shift).item()
    t = torch.linspace(1.0, sigma_min, num_steps, dtype=torch.float64)
    return static_shift(t, shift)


def sd3_sigmas(num_steps: int, shift: float = 3.0, *, num_train_timesteps: int = 1000) -> torch.Tensor:
    """FlowGRPO-SD3 schedule: ``FlowMatchEulerDiscreteScheduler(shift=shift)`` sigmas; (N+1,) fp32, last 0."""
    _check_num_steps(num_steps)
    _check_shift(shift)
    return _append_zero(_flow_match_default_sigmas(num_steps, shift, num_train_timesteps))


def wan_sigmas(num_steps: int, shift: float = 3.0, *, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Wan schedule: a diffusers Wan pipeline's ``FlowMatchEulerDiscreteScheduler(shift=shift)`` sigmas.

    Wan2.1 uses flow shift 3.0 at 480p and 5.0 at 720p. Returns (N+1,) float32, last 0.
    """
    _check_num_steps(num_steps)
    _check_shift(shift)
    return _append_zero(_flow_match_default_sigmas(num_steps, shift, num_train_timesteps))


def dance_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """DanceGRPO schedule: linspace(1, 0, N+1) then ``s·t / (1 + (s − 1)·t)``; (N+1,) fp32, last 0.

    Computed in float32 in the reference's operation order, so ``int(sigma * 1000)`` (the timestep the
    reference gives its model) is reproduced bit for bit.
    """
    _check_num_steps(num_steps)
    _check_shift(shift)
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    return (shift * t) / (1 + (shift - 1) * t)


def get_sigmas(
    kind: str,
    num_steps: int,
    *,
    image_seq_len: int | None = None,
    shift: float | None = None,
) -> torch.Tensor:
    """Sigma schedule by name (``flux | sd3 | dance | wan | qwen_image``): (num_steps+1,) float32 from 1 down
    to 0.

    ``flux`` and ``qwen_image`` need ``image_seq_len`` and reject ``shift`` (their shift is dynamic); the others
    take ``shift`` (default 3.0) and reject ``image_seq_len``.
    """
    if kind not in SIGMA_KINDS:
        raise ValueError(f"unknown sigma schedule {kind!r}; valid kinds: {', '.join(SIGMA_KINDS)}")
    if kind in _DYNAMIC_KINDS:
        if image_seq_len is None:
            raise ValueError(f"the {kind} schedule needs image_seq_len (packed latent tokens)")
        if shift is not None:
            raise ValueError(f"the {kind} schedule shifts dynamically from image_seq_len; pass shift=None")
        dynamic = flux_sigmas if kind == "flux" else qwen_image_sigmas
        return dynamic(num_steps, image_seq_len)
    if image_seq_len is not None:
        raise ValueError(f"image_seq_len applies only to the flux and qwen_image schedules, not {kind!r}")
    shift = _DEFAULT_SHIFT[kind] if shift is None else shift
    builders = {"sd3": sd3_sigmas, "dance": dance_sigmas, "wan": wan_sigmas}
    return builders[kind](num_steps, shift)


def schedule_times(kind: str, num_steps: int, *, shift: float | None = None) -> torch.Tensor:
    """The (num_steps + 1,) times of schedule ``kind`` before its shift, in the dtype its builder shifts them in:
    ``dance`` linspace(1, 0, T+1) (float32), ``flux`` linspace(1, 1/T, T) and 0 (float32), ``sd3`` / ``wan`` the
    scheduler's linspace(1, σ_min, T) (which depends on ``shift``) and 0 (float64)."""
    _check_num_steps(num_steps)
    if kind not in SIGMA_KINDS:
        raise ValueError(f"unknown sigma schedule {kind!r}; valid kinds: {', '.join(SIGMA_KINDS)}")
    if kind == "qwen_image":  # its terminal stretch rescales the whole schedule: no shift of a time grid gives it
        raise ValueError("the qwen_image schedule is stretched to its terminal sigma after the shift, so its tail "
                         "cannot be re-spaced on a time grid; use sampler.ode_steps_after_window as a count")
    if kind == "dance":
        return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    if kind == "flux":
        t = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).to(torch.float32)
        return torch.cat([t, torch.zeros(1, dtype=torch.float32)])
    shift = _DEFAULT_SHIFT[kind] if shift is None else shift
    sigma_min = static_shift(torch.tensor(1.0 / _NUM_TRAIN_TIMESTEPS, dtype=torch.float32), shift).item()
    t = torch.linspace(1.0, sigma_min, num_steps, dtype=torch.float64)
    return torch.cat([t, torch.zeros(1, dtype=torch.float64)])


def shift_times(kind: str, times: torch.Tensor, *, shift: float | None = None,
                image_seq_len: int | None = None) -> torch.Tensor:
    """Schedule ``kind``'s time shift applied to ``times`` (from :func:`schedule_times`, or between them), with the
    builder's operations and precision; float32. ``shift_times(kind, schedule_times(kind, T))`` is the schedule."""
    if kind == "flux":
        if image_seq_len is None:
            raise ValueError("the flux schedule needs image_seq_len (packed latent tokens)")
        exp_mu = torch.tensor(math.exp(flux_mu(image_seq_len)), dtype=torch.float32)
        one = torch.ones((), dtype=torch.float32)
        return exp_mu / (exp_mu + (one / times.to(torch.float32) - one))  # t = 0 gives exp_mu / inf = 0
    shift = _DEFAULT_SHIFT[kind] if shift is None else shift
    if kind == "dance":
        t = times.to(torch.float32)
        return (shift * t) / (1 + (shift - 1) * t)
    return static_shift(times.to(torch.float64), shift).to(torch.float32)


@dataclass(frozen=True)
class SigmaSpec:
    """A schedule by its formula (kind, static shift, FLUX's token count): its sigmas at any number of steps, and
    its tail re-spaced on its own time grid (MixGRPO-Flash's compression after the SDE window,
    docs/algorithms.md §8)."""

    kind: str
    """One of ``SIGMA_KINDS``."""
    shift: float | None = None
    """Static shift of sd3 / wan / dance (None: 3.0); unused by flux."""
    image_seq_len: int | None = None
    """Packed latent tokens (flux and qwen_image only)."""

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The (num_steps + 1,) float32 sigmas (:func:`get_sigmas`)."""
        if self.kind in _DYNAMIC_KINDS:
            return get_sigmas(self.kind, num_steps, image_seq_len=self.image_seq_len)
        return get_sigmas(self.kind, num_steps, shift=self.shift)

    def respaced_tail(self, num_steps: int, start: int, steps: int) -> torch.Tensor:
        """(steps,) float32 sigmas after σ_start of a T-step schedule that take ``steps`` equal steps of its unshifted
        time from t_start to 0, the last one 0: the shift of linspace(t_start, 0, steps + 1)[1:]. MixGRPO-Flash
        re-spaces its schedule after the window this way (its t_start read off the grid as a Python float)."""
        if not 0 <= start < num_steps or steps < 1:
            raise ValueError(f"a tail of {steps} steps from step {start} of {num_steps} is empty")
        times = schedule_times(self.kind, num_steps, shift=self.shift)
        grid = torch.linspace(times[start].item(), 0.0, steps + 1, dtype=times.dtype)
        return shift_times(self.kind, grid[1:], shift=self.shift, image_seq_len=self.image_seq_len)


def timesteps_from_sigmas(sigmas: torch.Tensor, kind: str) -> torch.Tensor:
    """Scheduler-scale timesteps in [0, 1000] for the given sigmas (float32, same shape).

    ``flux | sd3 | wan | qwen_image``: ``sigma * 1000`` rounded in float32, exactly diffusers'
    ``scheduler.timesteps``.
    ``dance``: ``int(sigma * 1000)`` (truncated toward zero, as DanceGRPO does), stored as float32.
    See the module docstring for what each transformer receives.
    """
    if kind not in SIGMA_KINDS:
        raise ValueError(f"unknown sigma schedule {kind!r}; valid kinds: {', '.join(SIGMA_KINDS)}")
    scaled = sigmas.to(torch.float32) * _NUM_TRAIN_TIMESTEPS
    if kind == "dance":
        return torch.trunc(scaled)
    return scaled


def transformer_timestep(
    timesteps: torch.Tensor, family: str, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The timestep a diffusers pipeline passes to its transformer, from scheduler-scale timesteps.

    ``flux`` and ``qwen_image``: ``timesteps.to(dtype) / 1000``, computed in ``dtype``: FluxPipeline and
    QwenImagePipeline first cast the timestep to the latents' dtype (so bf16 latents give a bf16-rounded
    timestep), then divide, and the transformer multiplies by 1000 again. ``sd3`` and ``wan``: the float32 timesteps unchanged
    (their pipelines pass ``t`` as is; ``dtype`` is not used).
    """
    if family not in TRANSFORMER_FAMILIES:
        raise ValueError(
            f"unknown transformer family {family!r}; valid families: {', '.join(TRANSFORMER_FAMILIES)}"
        )
    if family in ("flux", "qwen_image"):
        return timesteps.to(dtype) / _NUM_TRAIN_TIMESTEPS
    return timesteps.to(torch.float32)
