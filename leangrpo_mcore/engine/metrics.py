"""Per-step metrics: one flat JSON object per step into ``metrics.jsonl``, TensorBoard scalars (and wandb's, see
:mod:`leangrpo_mcore.engine.wandb_log`), a progress bar.

Only rank 0 writes. Rows are flushed line by line, so a killed run leaves at most one torn last line (which
:func:`~leangrpo_mcore.engine.run_dir.read_metrics` ignores). NaN/inf values are written as the strings
``"nan"``/``"inf"`` (JSON has no such numbers) and left out of TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

if TYPE_CHECKING:
    from leangrpo_mcore.engine.wandb_log import WandbRun

Scalar = float | int


def reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """``reward_mean`` and ``reward_std`` (population std, ddof 0) of all rewards of a step, in float64."""
    values = rewards.detach().double().flatten()
    if values.numel() == 0:
        return {"reward_mean": math.nan, "reward_std": math.nan}
    return {"reward_mean": float(values.mean()), "reward_std": float(values.std(unbiased=False))}


def _json_number(value: Scalar) -> Any:
    # JSON has no NaN/inf: write them as strings so that every row stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Writes metric rows (rank 0 only; on other ranks every method is a no-op)."""

    def __init__(self, metrics_path: str, tensorboard_dir: Optional[str], *, enabled: bool,
                 purge_step: Optional[int] = None, wandb: Optional[WandbRun] = None) -> None:
        """``wandb``: an open wandb run that receives the same scalars and images (closed by :meth:`close`)."""
        self.enabled = enabled
        self._file = None
        self._writer = None
        self._wandb = wandb if enabled else None
        if not enabled:
            return
        self._file = open(metrics_path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            # purge_step hides the events a killed run wrote past the resumed checkpoint.
            self._writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=purge_step)

    def log(self, step: int, row: Mapping[str, Scalar]) -> None:
        """Append ``{"step": step, **row}`` to metrics.jsonl and every finite number to TensorBoard and wandb."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _json_number(v) for k, v in row.items() if k != "step"}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key.replace(".", "/"), value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(step, row)

    def add_image(self, tag: str, image_hwc_uint8: Any, step: int) -> None:
        """Log an (H, W, 3) uint8 image to TensorBoard and wandb."""
        if self._writer is not None:
            self._writer.add_image(tag, image_hwc_uint8, global_step=step, dataformats="HWC")
        if self._wandb is not None:
            self._wandb.log_image(tag, image_hwc_uint8, step)

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


class ProgressBar:
    """A tqdm bar on rank 0 showing step, reward, loss and step time; silent elsewhere or when disabled."""

    def __init__(self, total: int, initial: int, *, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, step: int, reward: float, loss: float, step_time_s: float) -> None:
        """Advance by one step and show the latest numbers."""
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"step={step} reward={reward:.4g} loss={loss:.4g} t={step_time_s:.2f}s")
        self._bar.update(1)

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
