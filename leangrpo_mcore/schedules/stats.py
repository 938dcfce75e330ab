"""What an update reports: its loss, the ratios of its trained rows (overall and per denoising step), the
provisional-gradient buffers it held; kept as device tensors and reduced over the data-parallel ranks once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["UpdateStats"]


@dataclass
class UpdateStats:
    """Diagnostics of one update on this rank, kept as device tensors (no host sync until :meth:`reduced`)."""

    clip_range: float = 0.0
    """ε used to count clipped ratios."""
    ratios: list[torch.Tensor] = field(default_factory=list)
    """Detached ρ of the trained rows, one tensor per unit."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Detached 0-d weighted losses (their sum is this rank's share of the update loss)."""
    max_local_grad_buffers: int = 0
    """Most provisional gradients held at once (Reweight)."""
    steps: list[int] = field(default_factory=list)
    """The denoising step of each entry of :attr:`ratios` (-1: not given)."""

    def add(self, ratio: torch.Tensor, loss: Optional[torch.Tensor] = None, step: Optional[int] = None) -> None:
        """Record the ratios ρ (of train rows) of one unit at denoising step ``step``, and its loss."""
        self.ratios.append(ratio.detach().flatten())
        self.steps.append(-1 if step is None else int(step))
        if loss is not None:
            self.losses.append(loss.detach().reshape(()))

    def _per_step(self, device: torch.device, num_steps: int) -> torch.Tensor:
        """(num_steps, 3) float64 per denoising step: Σρ, clipped count, count."""
        out = torch.zeros(num_steps, 3, dtype=torch.float64, device=device)
        for ratio, step in zip(self.ratios, self.steps):
            if 0 <= step < num_steps:
                r = ratio.to(device, torch.float64)
                out[step] += torch.stack([r.sum(), ((r - 1).abs() > self.clip_range).sum().to(torch.float64),
                                          torch.tensor(float(r.numel()), dtype=torch.float64, device=device)])
        return out

    def reduced(self, dp_group, device: torch.device, num_steps: int = 0) -> dict:
        """loss, ratio extremes and mean, clip fraction over the data-parallel ranks (``dp_group``; None: local);
        with ``num_steps``, ``per_step``: {t: (Σρ, clipped, count)} of every denoising step t < num_steps that trained
        (ratios added with their step), to be pooled over updates."""
        device = device if device.type == "cuda" else torch.device("cpu")
        ratio = torch.cat([r.to(device, torch.float64) for r in self.ratios]) if self.ratios else \
            torch.ones(0, dtype=torch.float64, device=device)
        loss = torch.stack([l.to(device, torch.float64) for l in self.losses]).sum() if self.losses else \
            torch.zeros((), dtype=torch.float64, device=device)
        clipped = ((ratio - 1).abs() > self.clip_range).sum()
        sums = torch.stack([loss, ratio.sum(), clipped.to(torch.float64),
                            torch.tensor(float(ratio.numel()), dtype=torch.float64, device=device)])
        sums = torch.cat([sums, self._per_step(device, num_steps).flatten()])  # one collective for both
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=device)
        low = ratio.min().reshape(1) if ratio.numel() else inf.reshape(1)
        high = ratio.max().reshape(1) if ratio.numel() else -inf.reshape(1)
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=dp_group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=dp_group)
        values = sums.cpu().tolist()
        loss_sum, ratio_sum, clipped_n, count = values[:4]
        per_step = {t: tuple(values[4 + 3 * t: 7 + 3 * t]) for t in range(num_steps) if values[6 + 3 * t] > 0}
        return {"loss": loss_sum, "ratio_min": float(low), "ratio_max": float(high),
                "ratio_mean": ratio_sum / count if count else 1.0, "clip_fraction": clipped_n / count if count else 0.0,
                "per_step": per_step}
