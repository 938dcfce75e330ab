"""GRPO policy losses and the KL penalty on SDE means (docs/algorithms.md §4).

Every function returns per-sample values (B,) in float32; the caller chooses the reduction (the
baselines take the batch mean). A new policy loss is one decorated function::

    @register_policy_loss("my_loss")
    def my_loss(log_prob, old_log_prob, advantages, *, clip_range): ...  # -> (loss (B,), PolicyLossMetrics)
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

KL_FORMS = ("flow_grpo", "exact")
GRAD_REWEIGHTS = ("none", "flow_grpo", "dancegrpo")


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Diagnostics of one policy-loss evaluation; each field a detached 0-d float32 tensor.

    Tensors, not floats, so that logging does not force a device sync every step.
    """

    clip_fraction: Tensor
    """Fraction of samples with |ρ − 1| > clip_range (FlowGRPO's ``clipfrac``)."""
    approx_kl: Tensor
    """mean ½ (log p − log p_old)², the low-variance estimate of KL(p_old ‖ p)."""
    ratio_mean: Tensor
    """Mean of ρ = exp(log p − log p_old); exactly 1 on-policy."""
    ratio_min: Tensor
    """Smallest ρ of the batch."""
    ratio_max: Tensor
    """Largest ρ of the batch."""

    def as_floats(self) -> Dict[str, float]:
        """The metrics as Python floats (one device sync), keyed by field name."""
        return {name: float(getattr(self, name)) for name in self.__dataclass_fields__}


PolicyLossFn = Callable[..., Tuple[Tensor, PolicyLossMetrics]]
POLICY_LOSSES: Dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn(log_prob, old_log_prob, advantages, *, clip_range) -> (loss (B,), metrics)``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss '{name}' is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def available_policy_losses() -> List[str]:
    """Names of the registered policy losses, sorted."""
    return sorted(POLICY_LOSSES)


def compute_policy_loss(
    kind: str, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, *, clip_range: float
) -> Tuple[Tensor, PolicyLossMetrics]:
    """Dispatch to the policy loss registered as ``kind``."""
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss '{kind}'; valid: {', '.join(available_policy_losses())}")
    return POLICY_LOSSES[kind](log_prob, old_log_prob, advantages, clip_range=clip_range)


def _check_batch(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor) -> None:
    shapes = {tuple(t.shape) for t in (log_prob, old_log_prob, advantages)}
    if log_prob.ndim != 1 or len(shapes) != 1:
        raise ValueError(
            "log_prob, old_log_prob and advantages must all have shape (B,), got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )


def clipped_surrogate(log_ratio: Tensor, advantages: Tensor, *, clip_range: float) -> Tuple[Tensor, Tensor]:
    """(per-sample max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ) of a (B,) float32 log-ratio; ``advantages`` are constants."""
    if not 0.0 < clip_range < 1.0:
        raise ValueError(f"clip_range must be in (0, 1), got {clip_range}")
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


@register_policy_loss("grpo")
def grpo_step_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, *, clip_range: float
) -> Tuple[Tensor, PolicyLossMetrics]:
    """Clipped surrogate of one denoising step, per sample: max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)).

    ρ = exp(log p − log p_old) with ε = ``clip_range``. Matches FlowGRPO's ``unclipped_loss`` /
    ``clipped_loss`` / ``torch.maximum`` and DanceGRPO's identical form, before their batch mean.
    ``old_log_prob`` and ``advantages`` are constants (detached); all math is float32. At ρ = 1 the
    gradient is −A·∇log p (docs/algorithms.md §6), which the recompute-free schedules rely on.
    """
    _check_batch(log_prob, old_log_prob, advantages)
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    loss, ratio = clipped_surrogate(log_ratio, advantages, clip_range=clip_range)
    with torch.no_grad():
        metrics = PolicyLossMetrics(
            clip_fraction=((ratio - 1.0).abs() > clip_range).float().mean(),
            approx_kl=0.5 * (log_ratio**2).mean(),
            ratio_mean=ratio.mean(),
            ratio_min=ratio.min(),
            ratio_max=ratio.max(),
        )
    return loss, metrics


def _per_sample_std(std: Tensor, like: Tensor, name: str, check: bool = True) -> Tensor:
    """A (B,) or broadcastable std as float32, reshaped to broadcast against ``like`` (B, ...); ``check``: that it is
    positive (a host sync on an accelerator)."""
    std = torch.as_tensor(std, device=like.device).detach().float()
    if std.ndim == 1 and like.ndim > 1 and std.shape[0] == like.shape[0]:
        std = std.reshape(-1, *([1] * (like.ndim - 1)))
    try:
        fits = torch.broadcast_shapes(std.shape, like.shape) == like.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {tuple(std.shape)} does not broadcast to {tuple(like.shape)}")
    if check and bool((std <= 0).any()):
        raise ValueError(f"{name} must be > 0 everywhere")
    return std


def kl_loss(
    mean: Tensor,
    ref_mean: Tensor,
    *,
    std_t: Optional[Tensor] = None,
    transition_std: Optional[Tensor] = None,
    form: str = "flow_grpo",
    sample_mean: Optional[Callable[[Tensor], Tensor]] = None,
    check: bool = True,
) -> Tensor:
    """KL penalty (B,) float32 between the policy's and the reference's SDE transition means.

    Both transitions are Gaussians with the same std, so per element KL = (μ − μ_ref)² / (2 s²);
    the result is the mean over all non-batch dims (the log-prob convention of docs/algorithms.md §2).

    - ``form="flow_grpo"``: s = ``std_t``, the SDE's std *without* the sqrt(−dt) factor, exactly as
      FlowGRPO's SD3/FLUX training code (``(μ − μ_ref)².mean(dims) / (2 std_dev_t²)``); since the
      transition variance is std_t²·|dt|, this is |dt| × the true KL of the step.
    - ``form="exact"``: s = ``transition_std``, the std of the transition (what ``sde_step`` returns
      as ``std``), giving the true Gaussian KL; FlowGRPO's Wan code uses this form.

    Stds are (B,) per-sample values or broadcastable to ``mean``; ``ref_mean`` and the std are
    treated as constants (detached); gradients flow through ``mean`` only. ``sample_mean`` replaces that mean
    when a sample is split over context-parallel ranks (``diffusion.sde.SampleMean``). ``check``: check the std is
    positive (reads it back from the device); a caller whose std is positive by construction passes False.
    """
    if form not in KL_FORMS:
        raise ValueError(f"unknown KL form '{form}'; valid: {', '.join(KL_FORMS)}")
    if mean.shape != ref_mean.shape or mean.ndim < 1:
        raise ValueError(
            f"mean and ref_mean must have the same (B, ...) shape, got {tuple(mean.shape)} and {tuple(ref_mean.shape)}"
        )
    wanted, other = ("std_t", "transition_std") if form == "flow_grpo" else ("transition_std", "std_t")
    given = {"std_t": std_t, "transition_std": transition_std}
    if given[wanted] is None or given[other] is not None:
        raise ValueError(f"KL form '{form}' takes {wanted} (and not {other})")
    diff = mean.float() - ref_mean.detach().float()
    std = _per_sample_std(given[wanted], diff, wanted, check)
    per_elem = diff**2 / (2.0 * std**2)
    if per_elem.ndim == 1:
        return per_elem
    if sample_mean is not None:
        return sample_mean(per_elem)
    return per_elem.mean(dim=tuple(range(1, per_elem.ndim)))


def ratio_norm_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor, *,
                         sample_mean: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """GRPO-Guard's RatioNorm of one step's log-ratio, per sample (B,) float32 (docs/algorithms.md §9):

        log ρ̃ = (log p − log p_old + mean_d (μ − μ_old)² / (2 s²)) · s

    with s the (B,) transition std. Under the rollout's noise, log p − log p_old has mean −mean_d (μ − μ_old)²/(2 s²)
    (the ratio's left shift): the added term centres it, and the factor s makes its spread independent of the
    step's noise. ``old_log_prob`` and ``old_mean`` are constants; the gradient flows through ``log_prob`` and
    ``mean``. ``sample_mean`` replaces the mean over a sample's elements under context parallelism."""
    s = torch.as_tensor(std, device=log_prob.device).detach().float().reshape(log_prob.shape[0], -1)[:, 0]
    drift = (mean.float() - old_mean.detach().float()) ** 2
    drift = sample_mean(drift) if sample_mean is not None else drift.flatten(1).mean(dim=1)
    return (log_prob.float() - old_log_prob.detach().float() + drift / (2.0 * s**2)) * s


def guard_step_weight(form: str, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """GRPO-Guard's gradient weight of a step, (B,) float32 (docs/algorithms.md §9): ``flow_grpo`` 1/|dt|,
    ``dancegrpo`` 1/(|dt|·(1 + η²·(1 − σ)/(2σ))), with |dt| = σ − σ' and η = ``noise_level``."""
    if form not in GRAD_REWEIGHTS or form == "none":
        raise ValueError(f"unknown gradient reweighting {form!r}; valid: flow_grpo, dancegrpo")
    s, n = sigma.double(), sigma_next.double()
    weight = 1.0 / (s - n)
    if form == "dancegrpo":
        weight = weight / (1.0 + noise_level**2 * (1.0 - s) / (2.0 * s))
    return weight.to(torch.float32)
