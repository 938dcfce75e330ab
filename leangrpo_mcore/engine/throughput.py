"""Throughput scalars of a step: samples per second (in all and per device), model TFLOP/s per device and MFU.

The FLOPs of a step come from the planner's count of the step the engine runs (:mod:`leangrpo_mcore.planner.flops`:
rollout forwards, trained forwards and backwards, Native's recompute, activation-checkpointing recompute, CFG
branches, KL reference forwards), counted once per sample over all ranks; per device is that over the world size,
so redundant work (TP-replicated layers, a CP rank's share of the sequence) is not counted twice. Everything the
step runs is counted, recomputes included, so a schedule that recomputes shows more TFLOP/s for the same samples:
``samples_per_s`` is the figure to compare schedules by, ``mfu`` how busy the devices are.

``mfu`` is the achieved TFLOP/s over the device's dense bf16 peak (:data:`PEAK_TFLOPS`, or ``logging.peak_tflops``);
on a device of unknown peak (a CPU) without that setting there is no ``mfu``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from leangrpo_mcore.errors import UserError

TIMED_SCALARS = ("samples_per_s", "samples_per_s_per_device", "tflops_per_device", "mfu")
"""The scalars :meth:`Throughput.scalars` adds to a step's metrics row: like ``time_*``, they vary between
otherwise identical runs."""

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIE", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX A6000", 155.0),
)
"""Dense (no sparsity) bf16 tensor-core TFLOP/s per device, by a part of the name ``torch.cuda.get_device_name``
reports, the more specific names first (an ``H100 80GB HBM3`` is the SXM part)."""


def peak_tflops_of(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a device by its name (:data:`PEAK_TFLOPS`), None when it is not in the table."""
    name = device_name.upper()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def device_peak_tflops(device: torch.device, configured: Optional[float] = None) -> Optional[float]:
    """``configured`` (``logging.peak_tflops``) when set, else the table's peak of a CUDA ``device`` (None on CPU)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class Throughput:
    """What a step's throughput scalars follow from; :meth:`scalars` turns a step time into them."""

    samples_per_step: int
    """Generations per step over all ranks."""
    devices: int
    """World size."""
    flops_per_step: Optional[float] = None
    """Model FLOPs of one step over all ranks (None: not countable for this model)."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device (None: unknown, no ``mfu``)."""
    flops_for_text: Optional[Callable[[int], float]] = None
    """FLOPs of one step whose prompts are ``n`` text tokens long, for a family that trims its text padding per
    step (Qwen-Image); None: ``flops_per_step`` for every step."""

    def scalars(self, seconds: float, text_tokens: Optional[int] = None) -> dict[str, float]:
        """``samples_per_s``, ``samples_per_s_per_device``, ``tflops_per_device`` and ``mfu`` of a step that took
        ``seconds`` (the last two where the FLOPs, and for ``mfu`` the peak, are known); ``text_tokens``: the
        length the step's prompts had."""
        if seconds <= 0:
            return {}
        rate = self.samples_per_step / seconds
        out = {"samples_per_s": rate, "samples_per_s_per_device": rate / self.devices}
        flops = self.flops_per_step
        if flops is not None and text_tokens is not None and self.flops_for_text is not None:
            flops = self.flops_for_text(int(text_tokens))
        if flops is not None:
            tflops = flops / self.devices / seconds / 1e12
            out["tflops_per_device"] = tflops
            if self.peak_tflops is not None:
                out["mfu"] = tflops / self.peak_tflops
        return out

    def describe(self) -> str:
        """One line for the log: FLOPs per step and the peak ``mfu`` is measured against."""
        flops = "not counted" if self.flops_per_step is None else f"{self.flops_per_step / 1e12:.4g} TFLOP per step"
        peak = "no mfu (unknown device peak; set logging.peak_tflops)" if self.peak_tflops is None else \
            f"mfu against {self.peak_tflops:g} TFLOP/s per device"
        return f"throughput: {self.samples_per_step} samples and {flops} over {self.devices} devices, {peak}"


def step_throughput(config: Any, schedule: str, world_size: int, device: torch.device) -> Throughput:
    """The :class:`Throughput` of ``config`` trained by ``schedule`` on ``world_size`` devices like ``device``."""
    # The planner's one entry for the runtime: imported here so that importing the engine loads no planner module.
    from leangrpo_mcore.planner import step_flops_for_config

    from leangrpo_mcore.data.text_encoder import MASKED_FAMILIES

    samples = config.grpo.prompts_per_step * config.grpo.group_size
    try:
        flops: Optional[float] = step_flops_for_config(config, schedule).total
    except UserError:  # a model the planner cannot describe: samples per second only
        flops = None
    per_text = None
    if flops is not None and config.model.family in MASKED_FAMILIES:
        # its prompts are trimmed to the step's longest, at most what flops_per_step counts
        per_text = functools.lru_cache(maxsize=None)(
            lambda n: step_flops_for_config(config, schedule, text_tokens=n).total)
    return Throughput(samples_per_step=samples, devices=world_size, flops_per_step=flops,
                      peak_tflops=device_peak_tflops(device, config.logging.peak_tflops), flops_for_text=per_text)
