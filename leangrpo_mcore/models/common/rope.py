"""Rotary position embedding (RoPE) with interleaved pairs, as used by FLUX and Wan.

Channels (2i, 2i+1) of a head form one rotated pair with angle ``pos * theta**(-2i/dim)``. The angle
table is built in float64 by default (positions reach thousands; float32 angles lose the low bits that the
reference implementations of FLUX and Wan keep; Qwen-Image's reference computes its angles in float32, and so
does its family here) and returned as float32 cos/sin of shape (S, dim), each frequency repeated twice so that it
lines up with both members of its pair. The rotation itself runs in fp32
whatever the activation dtype, and casts back at the end.
"""

from __future__ import annotations

from typing import Sequence

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float = 10000.0, *,
                 angle_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (S, dim), float32, for 1-D ``positions`` (S,) and an even head-channel count ``dim``;
    frequencies and angles computed in ``angle_dtype``."""
    if dim % 2 != 0:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D (S,), got shape {tuple(positions.shape)}")
    exponent = torch.arange(0, dim, 2, dtype=angle_dtype, device=positions.device) / dim
    inv_freq = 1.0 / (theta ** exponent)
    angles = torch.outer(positions.to(angle_dtype), inv_freq)
    cos = angles.cos().repeat_interleave(2, dim=1).float()
    sin = angles.sin().repeat_interleave(2, dim=1).float()
    return cos, sin


def multi_axis_rope_cos_sin(ids: torch.Tensor, axes_dims: Sequence[int], theta: float = 10000.0, *,
                            angle_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (S, sum(axes_dims)) for positions ``ids`` (S, n_axes): one RoPE per axis, concatenated."""
    if ids.ndim != 2 or ids.shape[1] != len(axes_dims):
        raise ValueError(f"ids must be (S, {len(axes_dims)}), got shape {tuple(ids.shape)}")
    tables = [rope_cos_sin(ids[:, axis], dim, theta, angle_dtype=angle_dtype) for axis, dim in enumerate(axes_dims)]
    return torch.cat([t[0] for t in tables], dim=-1), torch.cat([t[1] for t in tables], dim=-1)


def _broadcastable(table: torch.Tensor) -> torch.Tensor:
    if table.ndim == 2:  # (S, D)
        return table[None, :, None, :]
    if table.ndim == 3:  # (B, S, D)
        return table[:, :, None, :]
    if table.ndim == 4:  # already (B|1, S, 1, D)
        return table
    raise ValueError(f"rotary table must have 2, 3 or 4 dims, got shape {tuple(table.shape)}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, S, H, D) by the tables ``cos``/``sin`` ((S, D), (B, S, D) or (B|1, S, 1, D)).

    Computed in fp32, returned in ``x.dtype``.
    """
    if x.ndim != 4:
        raise ValueError(f"apply_rotary expects (B, S, H, D), got shape {tuple(x.shape)}")
    cos, sin = _broadcastable(cos).float(), _broadcastable(sin).float()
    if cos.shape[-1] != x.shape[-1] or cos.shape[1] != x.shape[1]:
        raise ValueError(f"rotary table {tuple(cos.shape)} does not match (B, S, H, D) = {tuple(x.shape)}")
    xf = x.float()
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    # Rotating the pair (a, b) by angle t gives (a cos t - b sin t, b cos t + a sin t); the "rotated"
    # tensor (-b, a) carries the sin terms.
    rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)
