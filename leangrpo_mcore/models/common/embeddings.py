"""Embedding pieces shared by FLUX and Wan: sinusoidal timestep features, MLP embedders, adaLN helpers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def timestep_embedding(timesteps: torch.Tensor, dim: int, *, flip_sin_to_cos: bool = True,
                       downscale_freq_shift: float = 0.0, scale: float = 1.0,
                       max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features (B, dim) in fp32 of 1-D ``timesteps`` (B,), may be fractional.

    Frequencies ``exp(-ln(max_period) * i / (dim/2 - downscale_freq_shift))``; the output is
    [cos, sin] when ``flip_sin_to_cos`` else [sin, cos] (the DDPM / diffusers convention).
    """
    if timesteps.ndim != 1:
        raise ValueError(f"timesteps must be 1-D (B,), got shape {tuple(timesteps.shape)}")
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / (half - downscale_freq_shift))
    angles = scale * (timesteps[:, None].float() * freqs[None, :])
    sin, cos = torch.sin(angles), torch.cos(angles)
    emb = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1))
    return emb


class MLPEmbedder(torch.nn.Module):
    """``linear_2(act(linear_1(x)))`` with replicated linears (diffusers' TimestepEmbedding /
    PixArtAlphaTextProjection share this shape and these parameter names)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, *, backend, config,
                 act: str = "silu") -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {act!r}; choose one of {', '.join(_ACTIVATIONS)}")
        self.act = act
        self.linear_1 = backend.replicated_linear(in_features, hidden, config=config)
        self.linear_2 = backend.replicated_linear(hidden, out_features, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed ``x`` (..., in_features)."""
        return self.linear_2(_ACTIVATIONS[self.act](self.linear_1(x)))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with per-sample (B, C) shift/scale broadcast over tokens."""
    return x * (1 + scale[:, None]) + shift[:, None]
