"""What the benchmark times: schedule variants, the data-parallel layouts Native runs on, and one build per layout.

A label is ``VARIANT`` (on the config's own layout) or ``VARIANT@LAYOUT`` (on :data:`LAYOUTS`' ``LAYOUT``). Each
layout is an :class:`Arm`: its own parallel context, policy, optimizer, forward probe, gradient capture and
training snapshot, built from the same config and seed (so the same initial weights), and one engine per label.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from leangrpo_mcore.bench.probe import ForwardProbe, GradientCapture, TrainingSnapshot
from leangrpo_mcore.bench.report import NATIVE_VARIANTS
from leangrpo_mcore.config import Config
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.launch import DistContext
from leangrpo_mcore.engine.optim import trainable_parameters
from leangrpo_mcore.engine.step import StepEngine
from leangrpo_mcore.parallel.mesh import ParallelContext


@dataclass(frozen=True)
class ScheduleVariant:
    """A benchmarked schedule: a registered schedule plus config settings."""

    schedule: str
    """Registered schedule name."""
    settings: tuple[tuple[str, str, object], ...] = ()
    """(section, field, value) set on a copy of the config."""


VARIANTS: dict[str, ScheduleVariant] = {
    "native": ScheduleVariant("native"),
    "native_coalesced": ScheduleVariant("native", (("schedule", "coalesce_sync", True),)),
    "retain": ScheduleVariant("retain"),
    "reweight": ScheduleVariant("reweight"),
    "reweight_affine": ScheduleVariant("reweight", (("schedule", "reweight_accumulate", "affine"),)),
}
"""Benchmark labels: the three schedules, Native with one coalesced reduce-scatter per update (the
paper's Table-1 ablation) and Reweight with the affine accumulators."""

LAYOUTS = ("sharded", "replicated")
"""Data-parallel layouts a label may name after ``@``: FSDP2 over all data-parallel ranks (dp_replicate 1), or a
replica on each (dp_shard 1, the DDP-class layout of the baselines' own loops)."""


def split_label(label: str) -> tuple[str, str]:
    """``native_coalesced@replicated`` → (``native_coalesced``, ``replicated``); a plain label's layout is ''."""
    variant, _, layout = label.partition("@")
    return variant, layout


def variant_config(config: Config, label: str) -> Config:
    """A copy of ``config`` with the settings of label ``label``'s variant (its layout is the arm's)."""
    variant = VARIANTS[split_label(label)[0]]
    out = copy.deepcopy(config)
    out.schedule.name = variant.schedule
    for section, name, value in variant.settings:
        setattr(getattr(out, section), name, value)
    return out


def layout_config(config: Config, layout: str, dp_size: int) -> Config:
    """A copy of ``config`` on data-parallel layout ``layout`` ('': the config's own) over ``dp_size`` ranks."""
    out = copy.deepcopy(config)
    if layout:
        out.parallel.dp_shard, out.parallel.dp_replicate = (dp_size, 1) if layout == "sharded" else (1, dp_size)
    return out


def layout_name(dp_shard: int, dp_replicate: int) -> str:
    """``sharded``, ``replicated`` or ``hsdp RxS`` for resolved degrees; ``single`` for one data-parallel rank."""
    if dp_shard == dp_replicate == 1:
        return "single"
    if dp_replicate == 1:
        return "sharded"
    return "replicated" if dp_shard == 1 else f"hsdp {dp_replicate}x{dp_shard}"


def native_candidates(labels: list[str], own_layout: str, dp_size: int) -> list[str]:
    """``labels`` and, after them, every Native the project can run that they leave out: per-backward and coalesced
    sync on each of :data:`LAYOUTS` (on the config's own layout under the plain label). None at one data-parallel
    rank, where neither the layout nor the sync changes what Native does."""
    out = list(labels)
    if dp_size == 1:
        return out
    for layout in (own_layout, *(name for name in LAYOUTS if name != own_layout)):
        for variant in NATIVE_VARIANTS:
            label = variant if layout == own_layout else f"{variant}@{layout}"
            if label not in out:
                out.append(label)
    return out


@dataclass
class Arm:
    """One data-parallel layout's build and the engines of its labels."""

    config: Config
    pctx: ParallelContext
    parts: build.PolicyParts
    probe: ForwardProbe
    snapshot: TrainingSnapshot
    capture: GradientCapture
    params: list[torch.nn.Parameter]
    engines: dict[str, StepEngine] = field(default_factory=dict)

    @property
    def layout(self) -> str:
        """The arm's layout by name (:func:`layout_name`)."""
        layout = self.pctx.layout
        return layout_name(int(layout.dp_shard), int(layout.dp_replicate))


def build_arm(config: Config, labels: list[str], dist_ctx: DistContext, source: Any, bridge: Any,
              pctx: ParallelContext | None = None) -> Arm:
    """The policy, optimizer and engines of ``labels`` on ``config``'s layout (``pctx``: its context, if built)."""
    pctx = build.build_context(config, dist_ctx) if pctx is None else pctx
    parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx), source=source)
    engines = {label: build.build_engine(variant_config(config, label), VARIANTS[split_label(label)[0]].schedule,
                                         parts, pctx, bridge) for label in labels}
    probe = ForwardProbe(next(iter(engines.values())).velocity_fn, dist_ctx.device)
    for engine in engines.values():
        engine.velocity_fn = probe
        engine.measure_memory = False
    params = trainable_parameters(parts.policy)
    parts.optimizer.register_step_post_hook(probe.after_optimizer_step)
    return Arm(config=config, pctx=pctx, parts=parts, probe=probe, params=params,
               capture=GradientCapture(parts.optimizer, params),
               snapshot=TrainingSnapshot.primed(params, parts.optimizer, parts.lr_scheduler), engines=engines)
