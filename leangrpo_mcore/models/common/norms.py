"""Normalisation layers computed in fp32 (cast back to the input dtype), TP-aware where needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leangrpo_mcore.models.common.init import constant_init, set_init
from leangrpo_mcore.models.common.tp import all_reduce_tp, copy_to_tp, divide, mark_tp_partitioned, tp_world_size


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    ``input_is_parallel=True`` declares that the module is applied to TP-sharded data with a
    replicated weight (e.g. FLUX's per-head q/k norm on this rank's heads): the weight then enters
    ``copy_to_tp`` so its gradient sums every rank's heads and equals the TP=1 gradient.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 input_is_parallel: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim, self.eps, self.input_is_parallel = dim, eps, input_is_parallel
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))
            set_init(self.weight, constant_init(1.0))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (..., dim)."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight is not None:
            weight = copy_to_tp(self.weight) if self.input_is_parallel else self.weight
            out = out * weight.float()
        return out.to(x.dtype)


class TPRMSNorm(torch.nn.Module):
    """RMSNorm whose statistic spans the FULL width ``dim`` while each TP rank holds ``dim / tp`` channels.

    The local sums of squares are all-reduced over TP (and so are their gradients: the statistic feeds
    every rank's shard). The weight is sharded along dim 0 and marked TP-partitioned.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.local_dim = divide(dim, tp_world_size())
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.local_dim, dtype=dtype))
            mark_tp_partitioned(self.weight, 0)
            set_init(self.weight, constant_init(1.0))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, *, heads: bool = False) -> torch.Tensor:
        """Normalise the local shard ``x`` (..., dim / tp) with the full-width statistic.

        ``heads=True``: ``x`` is (..., heads_local, head_dim), e.g. a strided view of a fused q/k/v output; the
        statistic spans both dimensions and the result keeps that shape (no copy to a flat layout first).
        """
        channels = x.shape[-2] * x.shape[-1] if heads else x.shape[-1]
        if channels != self.local_dim:
            raise ValueError(f"TPRMSNorm expects {self.local_dim} local channels, got {channels}")
        dims = (-2, -1) if heads else (-1,)
        xf = x.float()
        sum_sq = all_reduce_tp(xf.pow(2).sum(dim=dims, keepdim=True), backward_all_reduce=True)
        out = xf * torch.rsqrt(sum_sq / self.dim + self.eps)
        if self.weight is not None:
            out = out * self.weight.float().view(x.shape[-2:] if heads else (-1,))
        return out.to(x.dtype)


class LayerNorm(torch.nn.Module):
    """LayerNorm over the last dimension in fp32; optional replicated affine ``weight`` / ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False, *,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))
            self.bias = torch.nn.Parameter(torch.zeros(dim, dtype=dtype))
            set_init(self.weight, constant_init(1.0))
            set_init(self.bias, constant_init(0.0))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (..., dim)."""
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (self.dim,), weight, bias, self.eps).to(x.dtype)
