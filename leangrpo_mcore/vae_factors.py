"""How many pixels one latent pixel of a policy's VAE covers (no torch: the planner reads it too).

FLUX.1's and SD3's ``AutoencoderKL``, Wan2.1's ``AutoencoderKLWan`` and Qwen-Image's ``AutoencoderKLQwenImage`` (16
latent channels) compress 8x per side;
Wan2.2's ``AutoencoderKLWan`` (48 latent channels, a 2x2 pixel patch before its three down-samplings)
compresses 16x. The trainer's latent grid, its decoder and the planner's token count all take the factor from
:func:`spatial_factor`.
"""

from __future__ import annotations

from typing import Any, Mapping

FLUX_SPATIAL_FACTOR = 8
SD3_SPATIAL_FACTOR = 8
QWEN_IMAGE_SPATIAL_FACTOR = 8
# SD3 / SD3.5's 16-channel AutoencoderKL normalises latents as (z - shift) * scaling (its vae/config.json).
SD3_SCALING_FACTOR = 1.5305
SD3_SHIFT_FACTOR = 0.0609
WAN21_SPATIAL_FACTOR = 8
WAN22_SPATIAL_FACTOR = 16
WAN22_LATENT_CHANNELS = 48


def wan_spatial_factor(in_channels: int, explicit: int | None = None) -> int:
    """The spatial factor of the VAE a Wan policy with ``in_channels`` latent channels pairs with;
    ``explicit`` (a config's ``vae_scale_factor_spatial``) wins when set."""
    if explicit:
        return int(explicit)
    return WAN22_SPATIAL_FACTOR if int(in_channels) == WAN22_LATENT_CHANNELS else WAN21_SPATIAL_FACTOR


def spatial_factor(family: str, config: Mapping[str, Any]) -> int:
    """The VAE spatial factor of a ``flux``, ``sd3``, ``wan`` or ``qwen_image`` policy of diffusers-style
    hyper-parameters ``config``."""
    if family == "wan":
        return wan_spatial_factor(config["in_channels"], config.get("vae_scale_factor_spatial"))
    factors = {"sd3": SD3_SPATIAL_FACTOR, "qwen_image": QWEN_IMAGE_SPATIAL_FACTOR}
    return factors.get(family, FLUX_SPATIAL_FACTOR)
