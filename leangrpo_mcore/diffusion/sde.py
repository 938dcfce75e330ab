"""One stochastic denoising step with its Gaussian log-density (docs/algorithms.md §2).

Variants, selected by name (``SDE_KINDS``):

- ``flow_grpo``: FlowGRPO "sde". std_t = a·sqrt(σ / (1 − σ̃)) with σ̃ = σ except σ̃ = ``sigma_max`` (the
  schedule's σ_1) where σ == 1; transition std s = std_t·sqrt(−dt).
- ``flow_grpo_cps``: FlowGRPO coefficients-preserving sampling. s = std_t = σ'·sin(a·π/2); the
  log-density drops every constant: log p = −(x' − μ)².
- ``wan``: FlowGRPO's Wan step. std_t = σ_min + (σ_max − σ_min)·σ (``sigma_max`` = σ_1, ``sigma_min`` = the
  schedule's last sigma); same mean and Gaussian log-density as ``flow_grpo``. The reference has no noise
  level for this step, so ``noise_level`` is not used.
- ``dance_grpo``: DanceGRPO's ``sde_solver`` step with a constant η = ``noise_level``: s = η·sqrt(σ − σ').
  Its mean x + dt·v − ½η²·score·dt equals the ``flow_grpo`` mean with std_t = η, which is how it is computed.

Conventions: σ = ``sigma`` and σ' = ``sigma_next`` are per-sample (B,) tensors (a float or 0-d tensor is
broadcast to the batch), dt = σ' − σ < 0. All math runs in float32 whatever the input dtype. ``log_prob`` is the
mean over all non-batch dimensions (not the sum), shape (B,), accumulated in float64 and returned as float32
(docs/algorithms.md §7). ``std`` is the transition std s with shape (B, 1, ..., 1), broadcastable to the sample.
``prev_sample`` is always returned detached: GRPO differentiates log p through the mean only.

Under context parallelism a sample's latent lives split over ranks: ``sample_mean`` then is the mean over the
whole sample's elements (partial sums reduced over the group, :mod:`leangrpo_mcore.parallel.sequence`), and
``noise`` the rank's piece of noise drawn for the whole sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

SDE_KINDS = ("flow_grpo", "flow_grpo_cps", "wan", "dance_grpo")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

Generators = torch.Generator | Sequence[torch.Generator] | None

SampleMean = Callable[[torch.Tensor], torch.Tensor]
"""(B, ...) → (B,): the mean over every non-batch element of each sample (a whole sample, or its CP pieces)."""


def local_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean over the non-batch elements of ``values`` (the whole sample is here)."""
    return values.flatten(1).mean(dim=1)


class SDEStep(NamedTuple):
    """Result of one SDE step; every tensor is float32."""

    prev_sample: torch.Tensor
    """x_{t+1}, shape (B, *shape), detached (drawn, or the given one cast to float32)."""
    log_prob: torch.Tensor
    """(B,) log-density of ``prev_sample`` (mean over non-batch dims); carries grad through ``mean``."""
    mean: torch.Tensor
    """(B, *shape) transition mean μ; carries grad from ``model_output``."""
    std: torch.Tensor
    """(B, 1, ..., 1) transition std s (the Gaussian's std; for ``flow_grpo_cps`` its std_t)."""


class TransitionStd(NamedTuple):
    """Standard deviations of one transition, elementwise in sigma's shape, float32."""

    std: torch.Tensor
    """s, the std of the Gaussian the log-density uses (std_t·sqrt(−dt); std_t itself for cps)."""
    std_t: torch.Tensor
    """std_t without the sqrt(−dt) factor (η for dance_grpo; equal to ``std`` for cps)."""


def _check_kind(kind: str) -> None:
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}; valid kinds: {', '.join(SDE_KINDS)}")


def _check_noise_level(kind: str, noise_level: float) -> None:
    if kind == "wan":
        return
    if not (isinstance(noise_level, (int, float)) and math.isfinite(noise_level) and noise_level > 0):
        raise ValueError(f"noise_level for {kind!r} must be a positive finite number, got {noise_level!r}")


def _scalar(value: float | torch.Tensor | None, name: str, kind: str) -> float:
    if value is None:
        raise ValueError(f"SDE kind {kind!r} needs {name} (see the schedule's sigmas)")
    value = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_decreasing(sigma: torch.Tensor, sigma_next: torch.Tensor) -> None:
    """ValueError unless every σ' < σ (steps go from noise to data); reads the data (a host sync on an accelerator)."""
    if not bool((sigma_next < sigma).all()):
        raise ValueError("every sigma_next must be smaller than its sigma (steps go from noise to data)")


def _usable_sigma_max(sigma_max: float | torch.Tensor | None) -> float | None:
    """``sigma_max`` as a float when it is a schedule's σ_1 in (0, 1), else None (read without a host sync when it
    is a float, as :class:`~leangrpo_mcore.diffusion.sampler.SDEParams` holds it)."""
    if sigma_max is None:
        return None
    value = float(sigma_max.item()) if isinstance(sigma_max, torch.Tensor) else float(sigma_max)
    return value if math.isfinite(value) and 0.0 < value < 1.0 else None


def _flow_grpo_std_t(
    sigma: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None
) -> torch.Tensor:
    at_one = sigma == 1
    sig_max = _usable_sigma_max(sigma_max)
    if sig_max is not None:
        # σ = 1 would divide by zero; the reference substitutes the schedule's σ_1 in the denominator only. The
        # substitution is a select, not a branch on the data: no host sync per step.
        denom_sigma = torch.where(at_one, sig_max, sigma)
    elif bool(at_one.any()):
        sig_max = _scalar(sigma_max, "sigma_max", "flow_grpo")
        raise ValueError(f"sigma_max must be the schedule's sigma_1 in (0, 1), got {sig_max}")
    else:
        denom_sigma = sigma
    return noise_level * torch.sqrt(sigma / (1 - denom_sigma))


def transition_std(
    kind: str,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float,
    sigma_max: float | torch.Tensor | None = None,
    sigma_min: float | torch.Tensor | None = None,
    *,
    check: bool = True,
) -> TransitionStd:
    """Transition std ``s`` and ``std_t`` of step σ → σ' for ``kind`` (elementwise, float32).

    ``s`` is what the log-density uses; ``std_t`` (s without sqrt(−dt)) is what FlowGRPO's SD3/FLUX KL
    divides by (docs/algorithms.md §4). ``sigma_max`` is needed by ``flow_grpo`` when σ == 1 and by ``wan``,
    ``sigma_min`` by ``wan``. ``check``: check σ' < σ (one host sync on an accelerator); the rollout loop checks its
    whole schedule once on the host instead (:meth:`~leangrpo_mcore.diffusion.sampler.SDEParams.check_schedule`).
    """
    _check_kind(kind)
    _check_noise_level(kind, noise_level)
    sigma = torch.as_tensor(sigma).to(torch.float32)
    sigma_next = torch.as_tensor(sigma_next).to(device=sigma.device, dtype=torch.float32)
    if sigma.shape != sigma_next.shape:
        raise ValueError(f"sigma {tuple(sigma.shape)} and sigma_next {tuple(sigma_next.shape)} differ in shape")
    if check:
        check_decreasing(sigma, sigma_next)
    sqrt_neg_dt = torch.sqrt(sigma - sigma_next)
    if kind == "flow_grpo_cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        return TransitionStd(std=std, std_t=std)
    if kind == "flow_grpo":
        std_t = _flow_grpo_std_t(sigma, noise_level, sigma_max)
    elif kind == "wan":
        sig_max = _scalar(sigma_max, "sigma_max", kind)
        sig_min = _scalar(sigma_min, "sigma_min", kind)
        std_t = sig_min + (sig_max - sig_min) * sigma
    else:
        std_t = torch.full_like(sigma, float(noise_level))
    return TransitionStd(std=std_t * sqrt_neg_dt, std_t=std_t)


def _batch_sigma(value: float | torch.Tensor, batch: int, name: str, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=torch.float32, device=device)
    if tensor.ndim == 0:
        return tensor.expand(batch)
    if tensor.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) or be a scalar, got {tuple(tensor.shape)}")
    return tensor


def _per_sample(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view(-1, *([1] * (ndim - 1)))


def draw_noise(shape: torch.Size, generator: Generators, device: torch.device) -> torch.Tensor:
    """Standard normal noise of ``shape`` in float32; one generator per sample when a list is given."""
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = device if generator is None else generator.device
        noise = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
        return noise.to(device)
    generators = list(generator)
    if len(generators) != shape[0]:
        raise ValueError(f"got {len(generators)} generators for a batch of {shape[0]} samples")
    draws = [
        torch.randn(shape[1:], generator=gen, device=gen.device, dtype=torch.float32).to(device)
        for gen in generators
    ]
    return torch.stack(draws)


def _gaussian_log_prob(prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                       sample_mean: SampleMean) -> torch.Tensor:
    """Mean over non-batch dims of log N(x'; μ, s²); ``std`` is (B, 1, ...). float64 reduction."""
    sq = sample_mean((prev_sample - mean).to(torch.float64).square())
    std64 = std.flatten(1)[:, 0].to(torch.float64)
    # log s and log sqrt(2π) are constant over the non-batch dims, so they leave the mean unchanged.
    log_prob = -sq / (2 * std64.square()) - torch.log(std64) - _LOG_SQRT_2PI
    return log_prob.to(torch.float32)


def _sde_mean(
    sample: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor, std_t: torch.Tensor
) -> torch.Tensor:
    """FlowGRPO's SDE mean x·(1 + std_t²·dt/(2σ)) + v·dt·(1 + std_t²·(1−σ)/(2σ)); all args broadcast."""
    var_over_2sigma = std_t.square() / (2 * sigma)
    return sample * (1 + var_over_2sigma * dt) + model_output * (1 + var_over_2sigma * (1 - sigma)) * dt


def _cps_mean(
    sample: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """(1 − σ')·x̂0 + sqrt(σ'² − std²)·x̂1 with x̂0 = x − σv, x̂1 = x + (1 − σ)v."""
    pred_x0 = sample - sigma * model_output
    pred_x1 = sample + (1 - sigma) * model_output
    # σ'² − std² = σ'²·cos²(aπ/2) ≥ 0; the clamp only removes a rounding-level negative at a = 1.
    noise_coeff = torch.sqrt((sigma_next.square() - std.square()).clamp_min(0))
    return (1 - sigma_next) * pred_x0 + noise_coeff * pred_x1


def _check_tensors(
    model_output: torch.Tensor, sample: torch.Tensor, prev_sample: torch.Tensor | None, generator: Generators
) -> None:
    if sample.ndim < 2:
        raise ValueError(f"sample must be batched (B, ...), got shape {tuple(sample.shape)}")
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output {tuple(model_output.shape)} and sample {tuple(sample.shape)} differ in shape")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(f"prev_sample {tuple(prev_sample.shape)} and sample {tuple(sample.shape)} differ in shape")
    if prev_sample is not None and generator is not None:
        raise ValueError("pass either prev_sample (to score it) or generator (to draw it), not both")


def sde_step(
    kind: str,
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: Generators = None,
    sigma_max: float | torch.Tensor | None = None,
    sigma_min: float | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    sample_mean: SampleMean = local_mean,
    check: bool = True,
) -> SDEStep:
    """One SDE step x_t → x_{t+1} of variant ``kind`` with the log-density of x_{t+1} (module docstring).

    ``model_output`` is the predicted velocity v, ``sample`` x_t, both (B, *shape). With ``prev_sample``
    given its log-density is evaluated; otherwise x_{t+1} = μ + s·ε with ε drawn in float32 from
    ``generator`` (a ``torch.Generator``, a sequence of B generators drawing one sample each, or None
    for the global RNG), or ``noise`` ε itself is given (float32, ``sample``'s shape). For ``dance_grpo``
    ``noise_level`` is η; ``wan`` does not use it. ``check``: check σ' < σ here (:func:`transition_std`).
    """
    _check_kind(kind)
    _check_tensors(model_output, sample, prev_sample, generator)
    if noise is not None and (prev_sample is not None or generator is not None or noise.shape != sample.shape):
        raise ValueError("noise is drawn by the caller alone (no prev_sample, no generator) in sample's shape")
    batch, ndim, device = sample.shape[0], sample.ndim, sample.device
    sample = sample.to(torch.float32)
    model_output = model_output.to(torch.float32)
    sigma = _batch_sigma(sigma, batch, "sigma", device)
    sigma_next = _batch_sigma(sigma_next, batch, "sigma_next", device)
    stds = transition_std(kind, sigma, sigma_next, noise_level, sigma_max=sigma_max, sigma_min=sigma_min,
                          check=check)
    std = _per_sample(stds.std, ndim)
    sig, sig_next = _per_sample(sigma, ndim), _per_sample(sigma_next, ndim)
    if kind == "flow_grpo_cps":
        mean = _cps_mean(sample, model_output, sig, sig_next, std)
    else:
        mean = _sde_mean(sample, model_output, sig, sig_next - sig, _per_sample(stds.std_t, ndim))
    if prev_sample is None:
        eps = draw_noise(sample.shape, generator, device) if noise is None else noise.to(device, torch.float32)
        prev_sample = mean.detach() + std * eps
    else:
        prev_sample = prev_sample.detach().to(device=device, dtype=torch.float32)
    if kind == "flow_grpo_cps":
        # The reference drops every constant of the cps log-density; it is still mean-reduced.
        log_prob = -sample_mean((prev_sample - mean).to(torch.float64).square()).to(torch.float32)
    else:
        log_prob = _gaussian_log_prob(prev_sample, mean, std, sample_mean)
    return SDEStep(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


def ode_step(
    model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor | float, sigma_next: torch.Tensor | float
) -> torch.Tensor:
    """Deterministic Euler step x + v·(σ' − σ) for evaluation; (B, *shape) float32."""
    _check_tensors(model_output, sample, None, None)
    batch, ndim, device = sample.shape[0], sample.ndim, sample.device
    sigma = _per_sample(_batch_sigma(sigma, batch, "sigma", device), ndim)
    sigma_next = _per_sample(_batch_sigma(sigma_next, batch, "sigma_next", device), ndim)
    return sample.to(torch.float32) + model_output.to(torch.float32) * (sigma_next - sigma)
