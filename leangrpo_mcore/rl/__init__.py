"""The RL math of diffusion GRPO: advantages, policy/KL losses and rewards (pure torch)."""

from .advantages import (
    ADVANTAGES,
    advantage_affine,
    available_advantages,
    clamp_would_fire,
    compute_advantages,
    group_mean_std,
    register_advantage,
)
from .loss import (
    KL_FORMS,
    POLICY_LOSSES,
    PolicyLossMetrics,
    available_policy_losses,
    compute_policy_loss,
    grpo_step_loss,
    kl_loss,
    register_policy_loss,
)
from .rewards import REWARDS, RewardError, available_rewards, build_reward, register_reward

__all__ = [
    "ADVANTAGES",
    "KL_FORMS",
    "POLICY_LOSSES",
    "REWARDS",
    "PolicyLossMetrics",
    "RewardError",
    "advantage_affine",
    "available_advantages",
    "available_policy_losses",
    "available_rewards",
    "build_reward",
    "clamp_would_fire",
    "compute_advantages",
    "compute_policy_loss",
    "grpo_step_loss",
    "group_mean_std",
    "kl_loss",
    "register_advantage",
    "register_policy_loss",
    "register_reward",
]
