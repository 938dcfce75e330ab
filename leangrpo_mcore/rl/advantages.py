"""Group-relative advantage estimators (docs/algorithms.md §4).

A new estimator is one decorated function::

    @register_advantage("my_kind")
    def my_kind(rewards, group_ids, *, eps=1e-6, global_std=False):
        ...  # float64 (N,) in, float64 (N,) out

``compute_advantages`` validates the inputs, runs the estimator in float64, clamps to
``±adv_clip_max`` and returns float32. Group-normalised estimators may also register their
affine form ``A_i = alpha_i * r_i + gamma_i`` (``register_advantage(name, affine=fn)``), which the
recompute-free schedules use to correct provisional gradients (docs/algorithms.md §6).

With several rewards (``reward.aggregate: advantages``) ``compute_advantages`` takes (N, K) rewards and their
``weights``: each column gets its own group advantage A_k and the advantage is clamp(Σ_k w_k A_k).
"""

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

AdvantageFn = Callable[..., Tensor]
AffineFn = Callable[..., Tuple[Tensor, Tensor]]

ADVANTAGES: Dict[str, AdvantageFn] = {}
AFFINE_ADVANTAGES: Dict[str, AffineFn] = {}

FLOW_GRPO_EPS = 1e-4
DANCE_GRPO_EPS = 1e-8


def register_advantage(name: str, *, affine: Optional[AffineFn] = None) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(rewards (N,) f64, group_ids (N,) long, *, eps, global_std) -> (N,) f64`` as ``name``.

    ``affine`` optionally gives the same estimator as ``(alpha (N,), gamma (N,))`` with
    ``A = alpha * r + gamma`` before clamping.
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage kind '{name}' is already registered")
        ADVANTAGES[name] = fn
        if affine is not None:
            AFFINE_ADVANTAGES[name] = affine
        return fn

    return decorator


def available_advantages() -> List[str]:
    """Names of the registered advantage estimators, sorted."""
    return sorted(ADVANTAGES)


def _lookup(kind: str, table: Dict[str, Callable]) -> Callable:
    if kind not in table:
        what = "advantage kind" if table is ADVANTAGES else "advantage kind with an affine form"
        raise ValueError(f"unknown {what} '{kind}'; valid: {', '.join(sorted(table))}")
    return table[kind]


def _validate(rewards: Tensor, group_ids: Tensor) -> Tuple[Tensor, Tensor]:
    """Check shapes/dtypes and return (rewards as float64, group_ids as long)."""
    if not isinstance(rewards, Tensor) or rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(getattr(rewards, 'shape', ()))}")
    if not isinstance(group_ids, Tensor) or group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must be a tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {tuple(getattr(group_ids, 'shape', ()))}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    rewards64 = rewards.detach().to(torch.float64)
    bad = int((~torch.isfinite(rewards64)).sum())
    if bad:
        raise ValueError(f"rewards contain {bad} non-finite values")
    return rewards64, group_ids.detach().to(device=rewards.device, dtype=torch.long)


def group_mean_std(
    rewards: Tensor, group_ids: Tensor, *, ddof: int, global_std: bool = False, kind: str = "advantage"
) -> Tuple[Tensor, Tensor]:
    """Per-sample group mean and std (both (N,), dtype of ``rewards``).

    The std uses ``ddof`` (0: population, 1: unbiased). With ``global_std`` the std is the one of all
    N rewards while the mean stays per group. Groups too small for ``ddof`` raise ValueError.
    """
    uniq, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    mean = (sums / counts.to(rewards.dtype))[inverse]
    if global_std:
        if rewards.numel() <= ddof:
            raise ValueError(
                f"{kind}: a global std with ddof {ddof} needs more than {ddof} rewards, got {rewards.numel()}"
            )
        std = torch.std(rewards, correction=ddof).expand_as(rewards)
        return mean, std
    if int(counts.min()) <= ddof:
        small = int(torch.nonzero(counts <= ddof)[0])
        raise ValueError(
            f"{kind}: every group needs more than {ddof} rewards (std with ddof {ddof}); "
            f"group id {int(uniq[small])} has {int(counts[small])}"
        )
    # Two-pass variance: subtracting the group mean first avoids cancellation for large rewards.
    sq = torch.zeros_like(sums).index_add_(0, inverse, (rewards - mean) ** 2)
    std = torch.sqrt(sq / (counts.to(rewards.dtype) - ddof))[inverse]
    return mean, std


def _flow_grpo_affine(
    rewards: Tensor, group_ids: Tensor, *, eps: float = FLOW_GRPO_EPS, global_std: bool = False
) -> Tuple[Tensor, Tensor]:
    mean, std = group_mean_std(rewards, group_ids, ddof=0, global_std=global_std, kind="flow_grpo")
    alpha = 1.0 / (std + eps)
    return alpha, -mean * alpha


def _dance_grpo_affine(
    rewards: Tensor, group_ids: Tensor, *, eps: float = DANCE_GRPO_EPS, global_std: bool = False
) -> Tuple[Tensor, Tensor]:
    mean, std = group_mean_std(rewards, group_ids, ddof=1, global_std=global_std, kind="dance_grpo")
    alpha = 1.0 / (std + eps)
    return alpha, -mean * alpha


@register_advantage("flow_grpo", affine=_flow_grpo_affine)
def flow_grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = FLOW_GRPO_EPS, global_std: bool = False) -> Tensor:
    """FlowGRPO (flow_grpo/stat_tracking.py): (r − mean_g) / (std_g + 1e-4), std with ddof 0.

    ``global_std=True`` replaces std_g by the std of all N rewards given (FlowGRPO's ``global_std``:
    the rewards of every rank for the step). Groups of one sample get advantage 0.
    """
    mean, std = group_mean_std(rewards, group_ids, ddof=0, global_std=global_std, kind="flow_grpo")
    return (rewards - mean) / (std + eps)


@register_advantage("dance_grpo", affine=_dance_grpo_affine)
def dance_grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = DANCE_GRPO_EPS, global_std: bool = False) -> Tensor:
    """DanceGRPO (fastvideo/train_grpo_*.py): (r − mean_g) / (std_g + 1e-8), torch's unbiased std (ddof 1).

    A group of one sample has no unbiased std (torch returns NaN there): it is a ValueError.
    ``global_std=True`` (not in DanceGRPO) uses the unbiased std of all N rewards.
    """
    mean, std = group_mean_std(rewards, group_ids, ddof=1, global_std=global_std, kind="dance_grpo")
    return (rewards - mean) / (std + eps)


def weighted_sum(values: Tensor, weights: Sequence[float]) -> Tensor:
    """Σ_k w_k · values[..., k], summed in float64 in the order of ``weights``; float32 shaped as values[..., 0]."""
    if values.ndim < 1 or values.shape[-1] != len(weights) or not weights:
        raise ValueError(f"weighted_sum: {len(weights)} weights for values of shape {tuple(values.shape)}")
    total: Optional[Tensor] = None
    for k, weight in enumerate(weights):
        term = weight * values[..., k].to(torch.float64)
        total = term if total is None else total + term
    return total.to(torch.float32)


def _weighted_advantage(fn: AdvantageFn, rewards: Tensor, group_ids: Tensor, weights: Sequence[float],
                        global_std: bool) -> Tensor:
    """Σ_k w_k · fn(rewards[:, k]) in float64: one group advantage per component reward, then the weighted sum."""
    if not isinstance(rewards, Tensor) or rewards.ndim != 2 or rewards.shape[1] != len(weights):
        raise ValueError(f"rewards of {len(weights)} components must be an (N, {len(weights)}) tensor, "
                         f"got shape {tuple(getattr(rewards, 'shape', ()))}")
    if not weights or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"component weights must be finite and at least one, got {list(weights)}")
    total: Optional[Tensor] = None
    for k, weight in enumerate(weights):
        column, ids = _validate(rewards[:, k], group_ids)
        term = weight * fn(column, ids, global_std=global_std)
        total = term if total is None else total + term
    return total


def _check_clip(adv_clip_max: Optional[float]) -> None:
    if adv_clip_max is not None and not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0 or None, got {adv_clip_max}")


def compute_advantages(
    kind: str,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    adv_clip_max: Optional[float],
    global_std: bool = False,
    weights: Optional[Sequence[float]] = None,
) -> Tensor:
    """Advantages (N,) float32 of ``rewards`` (N,) grouped by ``group_ids`` (N,), any order of ids.

    Computed in float64, then clamped to ``±adv_clip_max`` (``None``: no clamp). With ``weights`` (K floats)
    ``rewards`` is (N, K): each component k gets its own advantage A_k (its own group means and stds, or global
    std), and the result is clamp(Σ_k w_k A_k), clamped after the sum (docs/algorithms.md §4).
    """
    fn = _lookup(kind, ADVANTAGES)
    _check_clip(adv_clip_max)
    if weights is None:
        rewards64, ids = _validate(rewards, group_ids)
        adv = fn(rewards64, ids, global_std=global_std)
    else:
        adv = _weighted_advantage(fn, rewards, group_ids, weights, global_std)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv.to(torch.float32)


def advantage_affine(
    kind: str, rewards: Tensor, group_ids: Tensor, *, global_std: bool = False
) -> Tuple[Tensor, Tensor]:
    """``(alpha (N,), gamma (N,))`` float64 with unclamped ``A_i = alpha_i * r_i + gamma_i``.

    For the group-normalised kinds alpha = 1 / (std + eps) and gamma = −mean · alpha of the sample's
    group. With ``global_std`` alpha is one common scalar, which lets a schedule divide an accumulated
    gradient by it once (valid only while ``clamp_would_fire`` is False).
    """
    fn = _lookup(kind, AFFINE_ADVANTAGES)
    rewards64, ids = _validate(rewards, group_ids)
    return fn(rewards64, ids, global_std=global_std)


def clamp_would_fire(advantages_unclamped: Tensor, adv_clip_max: Optional[float]) -> bool:
    """True when clamping to ±adv_clip_max would change any of ``advantages_unclamped``."""
    _check_clip(adv_clip_max)
    if adv_clip_max is None:
        return False
    return bool((advantages_unclamped.detach().abs() > adv_clip_max).any())
