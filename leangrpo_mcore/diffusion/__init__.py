"""Diffusion math of flow-matching GRPO, pure torch in float32: sigma schedules, SDE steps, trajectories."""

from leangrpo_mcore.diffusion.sde import SDE_KINDS, SDEStep, TransitionStd, ode_step, sde_step, transition_std
from leangrpo_mcore.diffusion.sigmas import (
    SIGMA_KINDS,
    TRANSFORMER_FAMILIES,
    dance_sigmas,
    flux_mu,
    flux_sigmas,
    get_sigmas,
    qwen_image_sigmas,
    sd3_sigmas,
    static_shift,
    timesteps_from_sigmas,
    transformer_timestep,
    wan_sigmas,
)
from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory

__all__ = [
    "SDE_KINDS",
    "SIGMA_KINDS",
    "TRANSFORMER_FAMILIES",
    "Conditioning",
    "SDEStep",
    "Trajectory",
    "TransitionStd",
    "dance_sigmas",
    "flux_mu",
    "flux_sigmas",
    "get_sigmas",
    "ode_step",
    "qwen_image_sigmas",
    "sd3_sigmas",
    "sde_step",
    "static_shift",
    "timesteps_from_sigmas",
    "transformer_timestep",
    "transition_std",
    "wan_sigmas",
]
