"""Latents of a sample split over the context-parallel group between denoising steps.

Under ``parallel.cp`` the sampler keeps only this rank's piece of every latent: the flattened elements of a
sample, cut into contiguous runs (the first ``numel % cp`` ranks one element more). The SDE step is elementwise,
so it runs on the piece as it is; what spans the whole sample is explicit:

- the policy call gathers the pieces, runs the sequence-parallel forward and keeps this rank's piece of the
  velocity (:class:`~leangrpo_mcore.diffusion.velocity.SplitVelocity`);
- the log-probability and the KL are means over every element of the sample: each rank sums its piece (in
  the dtype given, float64 for the log-prob) and the partial sums are all-reduced over the CP group
  (:meth:`LatentSplit.sample_mean`). The all-reduce passes gradients through unchanged: each rank's loss is
  the whole sample's loss, and its backward reaches only its own elements, so the CP ranks' gradients add
  up to the sample's gradient (no factor cp);
- the noise of every step is drawn for the whole sample from its seed and cut, so that the trajectory is the
  one of cp = 1;
- the final latents are gathered for decoding, which happens once per sample.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from leangrpo_mcore.models.common.context_parallel import split_sizes


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward; identity in backward (the result is consumed identically on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class LatentSplit:
    """This rank's piece of latents of shape (B, *latent_shape), as (B, n_local) float32 rows."""

    def __init__(self, latent_shape: tuple[int, ...], group) -> None:
        self.latent_shape = tuple(int(d) for d in latent_shape)
        self.group = group
        self.numel = math.prod(self.latent_shape)
        self.sizes = split_sizes(self.numel, dist.get_world_size(group))
        self.rank = dist.get_rank(group)
        self.start = sum(self.sizes[:self.rank])
        self.local = self.sizes[self.rank]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """(B, *latent_shape) → (B, n_local): this rank's elements (a view; autograd-transparent)."""
        if tuple(full.shape[1:]) != self.latent_shape:
            raise ValueError(f"expected latents (B, {self.latent_shape}), got {tuple(full.shape)}")
        return full.flatten(1).narrow(1, self.start, self.local)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(B, n_local) → (B, *latent_shape) on every CP rank (no gradient: latents are detached inputs)."""
        if local.ndim != 2 or local.shape[1] != self.local:
            raise ValueError(f"expected a latent piece (B, {self.local}), got {tuple(local.shape)}")
        longest = max(self.sizes)
        padded = local.new_zeros(local.shape[0], longest)
        padded[:, :self.local] = local.detach()
        pieces = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(pieces, padded, group=self.group)
        whole = torch.cat([p[:, :n] for p, n in zip(pieces, self.sizes)], dim=1)
        return whole.view(local.shape[0], *self.latent_shape)

    def sample_mean(self, values: torch.Tensor) -> torch.Tensor:
        """(B, n_local) → (B,) mean over every element of each sample, in ``values.dtype`` (see module doc)."""
        partial = values.flatten(1).sum(dim=1)
        return _SumOverGroup.apply(partial, self.group) / self.numel
