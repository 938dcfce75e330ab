"""Wan2.2-A14B: one policy made of two Wan transformers and a boundary between them.

diffusers' ``WanPipeline(transformer=..., transformer_2=..., boundary_ratio=...)`` runs ``transformer`` (the
high-noise expert) at every denoising step whose scheduler timestep t satisfies ``t >= boundary_ratio *
num_train_timesteps`` and ``transformer_2`` (the low-noise expert) at the others. :class:`WanExperts` does the same
inside one module: its forward takes a Wan forward's arguments and routes each sample to its expert by its
float32 timestep (a per-token timestep routes by its largest entry, the noisy tokens'), so the sampler, the
schedules and the pipeline stages see one policy. A step's gradient reaches only the expert that ran it.

Both experts have the architecture of ``config`` (the released experts share one ``config.json``) and share that
config object, so a run-time switch set on it (activation checkpointing) reaches both. Parameters are named
``high.*`` and ``low.*``; in diffusers terms they are ``transformer.*`` and ``transformer_2.*``
(:mod:`leangrpo_mcore.models.wan.convert`). Each expert's blocks are FSDP2 units of their own and each expert's
remaining parameters (embedders, output head) one more unit (:meth:`WanExperts.fsdp_groups`), so a forward gathers
only the expert it runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from leangrpo_mcore.models.common.pipeline import PipelineStage
from leangrpo_mcore.models.common.policy import PolicyMixin
from leangrpo_mcore.models.wan.config import EXPERTS, NUM_TRAIN_TIMESTEPS, WanConfig
from leangrpo_mcore.models.wan.model import WanModel
"""The schedulers' ``num_train_timesteps`` that ``boundary_ratio`` scales (every released Wan pipeline's)."""


def boundary_timestep(boundary_ratio: float) -> float:
    """The scheduler timestep at which the low-noise expert takes over (diffusers computes it the same way)."""
    return boundary_ratio * NUM_TRAIN_TIMESTEPS


class WanExperts(PolicyMixin, nn.Module):
    """Two Wan transformers (``high``, ``low``) behind one forward that routes each sample by its timestep."""

    def __init__(self, config: WanConfig, *, backend: str = "auto", stage: Optional[PipelineStage] = None) -> None:
        super().__init__()
        if not isinstance(config, WanConfig) or config.boundary_ratio is None:
            raise ValueError("WanExperts needs a WanConfig with a boundary_ratio")
        self.config = config
        self.high = WanModel(config, backend=backend, stage=stage)
        self.low = WanModel(config, backend=backend, stage=stage)
        self.stage = self.high.stage

    def expert(self, name: str) -> WanModel:
        """The expert called ``name`` (``high`` or ``low``)."""
        if name not in EXPERTS:
            raise ValueError(f"unknown Wan expert {name!r}; valid: {', '.join(EXPERTS)}")
        return getattr(self, name)

    def blocks(self) -> list[nn.Module]:
        """Every transformer block, the high-noise expert's first (each its own FSDP2 unit)."""
        return self.high.blocks() + self.low.blocks()

    def fsdp_groups(self) -> list[nn.Module]:
        """Modules wrapped as FSDP2 units after the blocks: each expert, holding its embedders and output head."""
        return [self.high, self.low]

    def tokens_for(self, height: int, width: int, frames: int = 1) -> int:
        """Video tokens of a video (both experts patchify alike; see :meth:`WanModel.tokens_for`)."""
        return self.high.tokens_for(height, width, frames)

    def boundary_shape(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       encoder_hidden_states_image: Optional[torch.Tensor] = None) -> tuple[int, int, int]:
        """The pipeline boundary of these arguments (the experts' boundaries are alike)."""
        return self.high.boundary_shape(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)

    def routes_high(self, timestep: torch.Tensor, batch: int) -> torch.Tensor:
        """(B,) bool on the timestep's device: the samples the high-noise expert runs."""
        t = timestep.to(torch.float32)
        t = t.expand(batch) if t.ndim == 0 else t.reshape(batch, -1).amax(dim=1)
        return t >= boundary_timestep(self.config.boundary_ratio)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each sample's expert output (see :meth:`WanModel.forward`): one expert call when the batch shares its
        expert (a rollout step), a call per expert otherwise, the rows put back in order. Reads the routing on
        the host once per forward, as diffusers' pipeline does."""
        batch = hidden_states.shape[0]
        high = self.routes_high(timestep, batch)
        received = None if self.stage.pre_process else self._take_stage_input(self.stage)
        inputs = (received, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        every = bool(high.all())
        if every or not bool(high.any()):
            return self._run("high" if every else "low", *inputs)
        rows = {"high": high.nonzero().flatten(), "low": (~high).nonzero().flatten()}
        outs = []
        for name, index in rows.items():
            outs.append(self._run(name, *(t if t is None or t.ndim == 0 else t.index_select(0, index)
                                          for t in inputs)))
        order = torch.argsort(torch.cat(list(rows.values())))
        return torch.cat(outs).index_select(0, order)

    def _run(self, name: str, received: Optional[torch.Tensor], hidden_states: torch.Tensor, timestep: torch.Tensor,
             encoder_hidden_states: torch.Tensor, image: Optional[torch.Tensor]) -> torch.Tensor:
        expert = self.expert(name)
        if received is not None:
            expert.set_input_tensor(received)
        return expert(hidden_states, timestep, encoder_hidden_states, image)


def wan_policy(config: WanConfig, *, backend: str = "auto", stage: Optional[PipelineStage] = None) -> nn.Module:
    """The Wan policy of ``config``: :class:`WanExperts` with a ``boundary_ratio``, else one :class:`WanModel`."""
    if isinstance(config, WanConfig) and config.boundary_ratio is not None:
        return WanExperts(config, backend=backend, stage=stage)
    return WanModel(config, backend=backend, stage=stage)
