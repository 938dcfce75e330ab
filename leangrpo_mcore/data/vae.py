"""Latent layouts and decoding latents to images through diffusers' VAEs.

FLUX samples packed latents (B, (h/2)·(w/2), C·4): 2×2 latent patches flattened into tokens, with h = H/f and
w = W/f the VAE latent size (FluxPipeline ``_pack_latents``). Its ``AutoencoderKL`` decodes
``z / scaling_factor + shift_factor``. SD3 samples unpacked latents (B, C, h, w) (its transformer patches them
itself) through an ``AutoencoderKL`` with the same normalisation (SD3.5's factors: scaling 1.5305, shift
0.0609). Wan samples video latents (B, C, F', h, w) with F' = (F − 1)/4 + 1; its
``AutoencoderKLWan`` decodes ``z · latents_std + latents_mean`` (per channel). Qwen-Image samples packed latents
as FLUX does; its ``AutoencoderKLQwenImage`` (a one-frame video VAE) decodes ``z · latents_std + latents_mean``
(per channel, QwenImagePipeline's normalisation) on a frame axis of one. f is the VAE's spatial factor
(:mod:`leangrpo_mcore.vae_factors`): 8 for FLUX and Wan2.1, 16 for Wan2.2's 48-channel VAE, which patches 2×2
pixels before its three down-samplings. Decoded pixels in [−1, 1] are mapped to [0, 1] as diffusers' image
processor does ((x + 1)/2, clamped).

``build_vae("tiny", ...)`` makes a small randomly initialised VAE with the policy's latent channels and spatial
factor (fixed by the seed) so CPU runs decode real images; ``build_vae("diffusers", ...)`` loads weights from a
local directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from leangrpo_mcore.diffusion.velocity import pack_flux_latents, unpack_flux_latents
from leangrpo_mcore.errors import UserError
from leangrpo_mcore import vae_factors
from leangrpo_mcore.vae_factors import (FLUX_SPATIAL_FACTOR, SD3_SCALING_FACTOR, SD3_SHIFT_FACTOR, WAN21_SPATIAL_FACTOR,
                                        WAN22_SPATIAL_FACTOR)

FAMILIES = ("flux", "sd3", "wan", "qwen_image")
VAE_KINDS = ("tiny", "diffusers")
WAN_TEMPORAL_FACTOR = 4
# FLUX.1's AutoencoderKL normalisation (the released vae/config.json).
FLUX_SCALING_FACTOR = 0.3611
FLUX_SHIFT_FACTOR = 0.1159
_CLASS_NAMES = {"flux": "AutoencoderKL", "sd3": "AutoencoderKL", "wan": "AutoencoderKLWan",
                "qwen_image": "AutoencoderKLQwenImage"}
_IMAGE_FAMILIES = ("flux", "sd3")
"""Families whose ``AutoencoderKL`` normalises latents with a scaling and a shift factor."""
PACKED_FAMILIES = ("flux", "qwen_image")
"""Families whose policy samples 2x2-packed latent tokens."""


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")


def latent_shape(
    family: str, height: int, width: int, frames: int = 1, channels: int = 16, *,
    spatial_factor: Optional[int] = None,
) -> tuple[int, ...]:
    """Per-sample latent shape the policy samples: FLUX and Qwen-Image packed (tokens, C·4); SD3 (C, H/f, W/f); Wan
    (C, F', H/f, W/f).

    ``spatial_factor`` is the VAE's spatial factor f (None: the family's VAE for ``channels`` latent channels,
    see :func:`leangrpo_mcore.vae_factors.spatial_factor`). Height and width must be multiples of 2·f (the 2×2
    patch of both policies); Wan needs ``frames`` = 4k + 1 and FLUX ``frames`` = 1.
    """
    _check_family(family)
    if channels < 1:
        raise ValueError(f"latent channels must be >= 1, got {channels}")
    f = spatial_factor or vae_factors.spatial_factor(family, {"in_channels": channels})
    step = 2 * f
    if height < step or width < step or height % step or width % step:
        raise UserError(f"sampler.height and sampler.width must be positive multiples of {step} (the VAE "
                        f"compresses {f}x, the policy patches 2x2), got {height}x{width}")
    h, w = height // f, width // f
    if family in PACKED_FAMILIES:
        if frames != 1:
            raise ValueError(f"{family} generates images: frames must be 1, got {frames}")
        return ((h // 2) * (w // 2), channels * 4)
    if family == "sd3":
        if frames != 1:
            raise ValueError(f"sd3 generates images: frames must be 1, got {frames}")
        return (channels, h, w)
    if frames < 1 or (frames - 1) % WAN_TEMPORAL_FACTOR:
        raise ValueError(f"wan frames must be {WAN_TEMPORAL_FACTOR}k + 1, got {frames}")
    return (channels, (frames - 1) // WAN_TEMPORAL_FACTOR + 1, h, w)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, (h/2)·(w/2), C·4): each 2×2 patch becomes one token (FluxPipeline's packing)."""
    return pack_flux_latents(latents)


def unpack_latents(
    latents: torch.Tensor, height: int, width: int, vae_scale_factor: int = FLUX_SPATIAL_FACTOR
) -> torch.Tensor:
    """(B, tokens, C·4) -> (B, C, h, w) for an image of ``height`` × ``width`` pixels (inverse of pack)."""
    if latents.ndim != 3 or latents.shape[2] % 4:
        raise ValueError(f"unpack_latents needs (B, tokens, C*4), got {tuple(latents.shape)}")
    h = 2 * (int(height) // (vae_scale_factor * 2))
    w = 2 * (int(width) // (vae_scale_factor * 2))
    if (h // 2) * (w // 2) != latents.shape[1]:
        raise ValueError(f"{latents.shape[1]} latent tokens do not match a {height}x{width} image ({(h // 2) * (w // 2)})")
    return unpack_flux_latents(latents, h, w)


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output in [−1, 1] -> float32 in [0, 1] (clamped)."""
    return (pixels.float() / 2 + 0.5).clamp(0, 1)


@dataclass
class DecodedImages:
    """Decoded samples: ``images`` (B, 3, H, W) float32 in [0, 1] (the first frame for video) and, for Wan,
    ``video`` (B, 3, F, H, W) float32 in [0, 1]."""

    images: torch.Tensor
    video: Optional[torch.Tensor] = None


class LatentDecoder:
    """A diffusers VAE with the family's latent normalisation; decodes in chunks without grad."""

    def __init__(self, vae: torch.nn.Module, family: str, *, batch_size: Optional[int] = None) -> None:
        """Wrap ``vae`` (AutoencoderKL for FLUX and SD3, AutoencoderKLWan for Wan, AutoencoderKLQwenImage for
        Qwen-Image), frozen and in eval mode."""
        _check_family(family)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"decode batch_size must be >= 1, got {batch_size}")
        self.vae = vae.eval().requires_grad_(False)
        self.family = family
        self.batch_size = batch_size
        config = vae.config
        self.latent_channels = int(config.latent_channels if family in _IMAGE_FAMILIES else config.z_dim)
        self.spatial_factor = _vae_spatial_factor(config, family)  # pixels per latent pixel, per side
        if family not in _IMAGE_FAMILIES:
            view = (1, self.latent_channels, 1, 1, 1)
            self._mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(view)
            self._std = torch.tensor(config.latents_std, dtype=torch.float32).view(view)

    @property
    def device(self) -> torch.device:
        """Device of the VAE weights."""
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the VAE weights."""
        return next(self.vae.parameters()).dtype

    def _chunks(self, tensor: torch.Tensor) -> Sequence[torch.Tensor]:
        return tensor.split(self.batch_size) if self.batch_size else [tensor]

    def _to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised policy latents (fp32) -> the VAE's latent space, in the VAE dtype."""
        latents = latents.float()
        if self.family in _IMAGE_FAMILIES:
            latents = latents / float(self.vae.config.scaling_factor) + float(self.vae.config.shift_factor or 0.0)
        else:
            latents = latents * self._std.to(latents.device) + self._mean.to(latents.device)
        return latents.to(self.device, self.dtype)

    @torch.no_grad()
    def decode(
        self, latents: torch.Tensor, *, height: Optional[int] = None, width: Optional[int] = None
    ) -> DecodedImages:
        """Policy latents -> images in [0, 1]. FLUX and Qwen-Image: packed (B, tokens, C·4), needs ``height`` and
        ``width``; Wan: (B, C, F', h, w)."""
        if self.family in PACKED_FAMILIES:
            if height is None or width is None:
                raise ValueError(f"decoding {self.family} latents needs the image height and width")
            latents = unpack_latents(latents, height, width, self.spatial_factor)
            if self.family == "qwen_image":  # a video VAE: one frame
                latents = latents.unsqueeze(2)
        expected_ndim = 4 if self.family in _IMAGE_FAMILIES else 5
        if latents.ndim != expected_ndim or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"{self.family} VAE expects {self.latent_channels}-channel latents of rank {expected_ndim}, "
                f"got {tuple(latents.shape)}"
            )
        pixels = torch.cat([to_unit_range(self.vae.decode(self._to_vae(c)).sample) for c in self._chunks(latents)])
        if self.family in _IMAGE_FAMILIES:
            return DecodedImages(images=pixels)
        return DecodedImages(images=pixels[:, :, 0], video=pixels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> normalised policy latents (float32, the distribution's mode). FLUX and Qwen-Image:
        (B, 3, H, W) -> packed; Wan: (B, 3, H, W) or (B, 3, F, H, W) -> (B, C, F', h, w)."""
        if self.family not in _IMAGE_FAMILIES and images.ndim == 4:
            images = images.unsqueeze(2)
        pixels = (images.float() * 2 - 1).to(self.device, self.dtype)
        latents = torch.cat([self.vae.encode(c).latent_dist.mode().float() for c in self._chunks(pixels)])
        if self.family in _IMAGE_FAMILIES:
            shift = float(self.vae.config.shift_factor or 0.0)
            latents = (latents - shift) * float(self.vae.config.scaling_factor)
            return pack_latents(latents) if self.family == "flux" else latents
        latents = (latents - self._mean.to(latents.device)) / self._std.to(latents.device)
        return pack_latents(latents[:, :, 0]) if self.family == "qwen_image" else latents


def _vae_spatial_factor(config: Any, family: str) -> int:
    """Spatial factor of a diffusers VAE: 2 per down-sampling stage, times Wan's pixel patch (Wan2.2: 2)."""
    if family in _IMAGE_FAMILIES:
        return 2 ** (len(config.block_out_channels) - 1)
    if family == "qwen_image":  # QwenImagePipeline's vae_scale_factor
        return 2 ** len(config.temperal_downsample)
    return 2 ** (len(config.dim_mult) - 1) * int(getattr(config, "patch_size", None) or 1)


def _tiny_vae(family: str, channels: int, factor: int) -> torch.nn.Module:
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    valid = (WAN21_SPATIAL_FACTOR, WAN22_SPATIAL_FACTOR) if family == "wan" else (FLUX_SPATIAL_FACTOR,)
    if factor not in valid:
        raise ValueError(f"a tiny {family} VAE compresses {' or '.join(map(str, valid))}x, not {factor}x")
    if family == "qwen_image":  # the release's layout and latent statistics (diffusers' defaults) at tiny width
        return AutoencoderKLQwenImage(base_dim=8, z_dim=channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                      temperal_downsample=[False, True, True],
                                      **({} if channels == 16 else {"latents_mean": [0.0] * channels,
                                                                    "latents_std": [1.0] * channels}))

    if family in _IMAGE_FAMILIES:
        flux = family == "flux"
        return AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            latent_channels=channels,
            norm_num_groups=4,
            scaling_factor=FLUX_SCALING_FACTOR if flux else SD3_SCALING_FACTOR,
            shift_factor=FLUX_SHIFT_FACTOR if flux else SD3_SHIFT_FACTOR,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    # Wan2.2's layout: a 2x2 pixel patch (12 = 3 colours x 4 pixels in and out) and residual down/up blocks.
    patched = factor == WAN22_SPATIAL_FACTOR
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=channels,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        is_residual=patched,
        patch_size=2 if patched else None,
        in_channels=12 if patched else 3,
        out_channels=12 if patched else 3,
        scale_factor_spatial=factor,
    )


def _vae_dir(path: str | Path, family: str) -> Path:
    root = Path(path)
    if (root / "vae" / "config.json").is_file():
        root = root / "vae"
    config = root / "config.json"
    if not config.is_file():
        raise UserError(f"no diffusers VAE at {path} (expected config.json there or in its vae/ folder)")
    try:
        class_name = json.loads(config.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"corrupt VAE config {config}: {exc}") from None
    if class_name != _CLASS_NAMES[family]:
        raise UserError(f"{config} is a {class_name}, a {family} policy needs {_CLASS_NAMES[family]}")
    return root


def build_vae(
    kind: str,
    family: str,
    path: Optional[str | Path] = None,
    seed: int = 0,
    *,
    latent_channels: Optional[int] = None,
    spatial_factor: Optional[int] = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: Optional[int] = None,
) -> LatentDecoder:
    """A :class:`LatentDecoder`: ``tiny`` (random, ``latent_channels`` wide, compressing ``spatial_factor``x
    (None: the family's VAE for those channels), fixed by ``seed``, global RNG untouched) or ``diffusers``
    (weights from ``path``, a VAE folder or a pipeline folder with ``vae/``). A VAE whose channels or spatial
    factor differ from the given ones is a :class:`UserError`."""
    _check_family(family)
    if kind == "tiny":
        if latent_channels is None or latent_channels < 1:
            raise ValueError("a tiny VAE needs latent_channels >= 1 (the policy's latent channels)")
        factor = spatial_factor or vae_factors.spatial_factor(family, {"in_channels": latent_channels})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            vae = _tiny_vae(family, latent_channels, factor)
    elif kind == "diffusers":
        if path is None:
            raise UserError("model.vae=diffusers needs model.vae_path")
        root = _vae_dir(path, family)
        from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

        classes = {"wan": AutoencoderKLWan, "qwen_image": AutoencoderKLQwenImage}
        cls: Any = classes.get(family, AutoencoderKL)
        try:
            vae = cls.from_pretrained(str(root), local_files_only=True, torch_dtype=dtype)
        except Exception as exc:  # noqa: BLE001 -- any loader failure is reported as one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UserError(f"cannot load {cls.__name__} from {root}: {type(exc).__name__}: {first}") from None
    else:
        raise ValueError(f"unknown VAE kind {kind!r}; valid: {', '.join(VAE_KINDS)}")
    if next(vae.parameters()).dtype != dtype:
        vae = vae.to(dtype=dtype)
    decoder = LatentDecoder(vae.to(device=device), family, batch_size=batch_size)
    if latent_channels is not None and decoder.latent_channels != latent_channels:
        raise UserError(f"VAE has {decoder.latent_channels} latent channels, the policy samples {latent_channels}")
    if spatial_factor is not None and decoder.spatial_factor != spatial_factor:
        raise UserError(f"VAE compresses {decoder.spatial_factor}x spatially, the policy expects {spatial_factor}x")
    return decoder
