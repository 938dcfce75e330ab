"""Per-step metrics: one flat JSON object per step into ``metrics.jsonl``, TensorBoard scalars (and wandb's, see
:mod:`leangrpo_mcore.engine.output.wandb_log`), progress output (bars on a terminal, one line per step otherwise).

Only rank 0 writes. Rows are flushed line by line, so a killed run leaves at most one torn last line (which
:func:`~leangrpo_mcore.engine.output.run_dir.read_metrics` ignores). NaN/inf values are written as the strings
``"nan"``/``"inf"`` (JSON has no such numbers) and left out of TensorBoard. A failed write is one line naming
the file (see :class:`MetricsLogger`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch

from leangrpo_mcore.engine.launch import LOGGER_NAME
from leangrpo_mcore.errors import UserError

if TYPE_CHECKING:
    from leangrpo_mcore.engine.output.wandb_log import WandbRun

Scalar = float | int

WANDB_ERRORS = (Exception,)
"""What a failing wandb call raises: wandb's own error types (a full disk, a lost service process) besides
OSError; every one becomes the one line naming wandb's files."""


def reward_stats(rewards: torch.Tensor, components: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, float]:
    """``reward_mean`` and ``reward_std`` (population std, ddof 0) of all rewards of a step, in float64, and
    ``reward_<name>_mean`` of each of the named ``components`` (the rewards of ``reward.aggregate: advantages``)."""
    values = rewards.detach().double().flatten()
    if values.numel() == 0:
        stats = {"reward_mean": math.nan, "reward_std": math.nan}
    else:
        stats = {"reward_mean": float(values.mean()), "reward_std": float(values.std(unbiased=False))}
    for name, component in (components or {}).items():
        column = component.detach().double().flatten()
        stats[f"reward_{name}_mean"] = float(column.mean()) if column.numel() else math.nan
    return stats


def per_step_ratios(updates: Any) -> dict[str, float]:
    """``ratio_mean.step_<t>`` and ``clip_fraction.step_<t>`` of every denoising step t trained in a step's updates,
    pooled over them (each update's ``per_step``: t → (Σρ, clipped ratios, ratios) over the ranks)."""
    pooled: dict[int, list[float]] = {}
    for update in updates:
        for t, values in update.per_step.items():
            acc = pooled.setdefault(t, [0.0, 0.0, 0.0])
            for k, value in enumerate(values):
                acc[k] += value
    out = {}
    for t in sorted(pooled):
        ratio_sum, clipped, count = pooled[t]
        out[f"ratio_mean.step_{t}"] = ratio_sum / count
        out[f"clip_fraction.step_{t}"] = clipped / count
    return out


def step_row(result: Any, *, elapsed: float, skipped: bool, lr: float, reward_names: list[str],
             nonfinite_streak: int, throughput: Mapping[str, float]) -> dict[str, Scalar]:
    """The ``metrics.jsonl`` row of a step's :class:`~leangrpo_mcore.engine.step.StepResult` (docs/metrics.md):
    rewards (and the named components of ``reward.aggregate: advantages``), the updates' loss, gradient norm,
    ratios and clipping, the learning rate, the throughput scalars, the phases' times and the memory peaks."""
    components = None
    if result.component_rewards is not None:
        components = {name: result.component_rewards[..., k] for k, name in enumerate(reward_names)}
    updates = result.updates
    row = {**reward_stats(result.rewards, components), "loss": sum(u.loss for u in updates) / len(updates),
           "advantage_abs_mean": float(result.advantages.double().abs().mean()),
           "grad_norm": updates[-1].grad_norm, "clip_fraction": sum(u.clip_fraction for u in updates) / len(updates),
           "ratio_min": min(u.ratio_min for u in updates), "ratio_max": max(u.ratio_max for u in updates),
           "ratio_mean": sum(u.ratio_mean for u in updates) / len(updates),
           "lr": lr, "skipped": int(skipped), "nonfinite_streak": nonfinite_streak, "time_step_s": elapsed}
    row.update(throughput)
    row.update({f"time_{phase}_s": seconds for phase, seconds in sorted(result.timings.items())})
    row.update(per_step_ratios(updates))
    if result.window_start is not None:
        row["sde_window_start"] = result.window_start
    if result.peak_memory_bytes is not None:
        row["peak_memory_bytes"] = int(result.peak_memory_bytes)
    # ru_maxrss is in kB on Linux: the process's peak resident memory so far (CPU runs have no allocator peak).
    row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def _json_number(value: Scalar) -> Any:
    # JSON has no NaN/inf: write them as strings so that every row stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Writes metric rows (rank 0 only; on other ranks every method is a no-op).

    A failure to write (a full disk, a missing permission) of metrics.jsonl, the TensorBoard events or wandb is
    a one-line :class:`~leangrpo_mcore.errors.UserError` naming the file; after it, :meth:`close` releases the
    files without raising again.
    """

    def __init__(self, metrics_path: str, tensorboard_dir: Optional[str], *, enabled: bool,
                 purge_step: Optional[int] = None, wandb: Optional[WandbRun] = None) -> None:
        """``wandb``: an open wandb run that receives the same scalars and images (closed by :meth:`close`)."""
        self.enabled = enabled
        self.failed = False
        self.metrics_path, self.tensorboard_dir = metrics_path, tensorboard_dir
        self._file = None
        self._writer = None
        self._wandb = wandb if enabled else None
        if not enabled:
            return
        with self._writing(metrics_path):
            self._file = open(metrics_path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            with self._writing(tensorboard_dir):
                os.makedirs(tensorboard_dir, exist_ok=True)
                # purge_step hides the events a killed run wrote past the resumed checkpoint.
                self._writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=purge_step)

    @contextlib.contextmanager
    def _writing(self, path: Optional[str], errors: tuple = (OSError,)) -> Iterator[None]:
        """Turn a failed write of ``path`` into its one-line UserError (callers attempt nothing after a failure:
        a half-written row must not be followed by more)."""
        try:
            yield
        except errors as err:
            self.failed = True
            where = getattr(err, "filename", None) or path
            reason = getattr(err, "strerror", None) or " ".join(str(err).split()) or type(err).__name__
            raise UserError(f"cannot write {where}: {reason}") from None

    def log(self, step: int, row: Mapping[str, Scalar]) -> None:
        """Append ``{"step": step, **row}`` to metrics.jsonl and every finite number to TensorBoard and wandb."""
        if not self.enabled or self.failed:
            return
        record = {"step": int(step), **{k: _json_number(v) for k, v in row.items() if k != "step"}}
        with self._writing(self.metrics_path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            with self._writing(self.tensorboard_dir):
                for key, value in row.items():
                    if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                        self._writer.add_scalar(key.replace(".", "/"), value, global_step=step)
        if self._wandb is not None:
            with self._writing(self._wandb.files, WANDB_ERRORS):
                self._wandb.log(step, row)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log finite ``scalars`` to TensorBoard and wandb only (not metrics.jsonl): the evaluation's ``eval/...``."""
        if not self.enabled or self.failed:
            return
        finite = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._writer is not None:
            with self._writing(self.tensorboard_dir):
                for key, value in finite.items():
                    self._writer.add_scalar(key, value, global_step=step)
                self._writer.flush()
        if self._wandb is not None:
            with self._writing(self._wandb.files, WANDB_ERRORS):
                self._wandb.log(step, finite)

    def add_image(self, tag: str, image_hwc_uint8: Any, step: int) -> None:
        """Log an (H, W, 3) uint8 image to TensorBoard and wandb."""
        if self.failed:
            return
        if self._writer is not None:
            with self._writing(self.tensorboard_dir):
                self._writer.add_image(tag, image_hwc_uint8, global_step=step, dataformats="HWC")
        if self._wandb is not None:
            with self._writing(self._wandb.files, WANDB_ERRORS):
                self._wandb.log_image(tag, image_hwc_uint8, step)

    def add_video(self, tag: str, path: str, step: int, fps: int) -> None:
        """Log the mp4 file at ``path`` to wandb (TensorBoard shows the PNG grid of first frames instead)."""
        if self._wandb is not None and not self.failed:
            with self._writing(self._wandb.files, WANDB_ERRORS):
                self._wandb.log_video(tag, path, step, fps)

    def close(self) -> None:
        """Flush and close the files; a failure to flush is a UserError naming the file, unless an earlier
        write failed already (that one was reported: the files are then released quietly)."""
        file, writer, wandb = self._file, self._writer, self._wandb
        self._file = self._writer = self._wandb = None
        for target, path, errors in ((file, self.metrics_path, (OSError,)), (writer, self.tensorboard_dir, (OSError,)),
                                     (wandb, wandb.files if wandb is not None else None, WANDB_ERRORS)):
            if target is None:
                continue
            if self.failed:
                with contextlib.suppress(Exception):
                    target.close()
                continue
            with self._writing(path, errors):
                target.close()


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or fake stream without ``isatty`` is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def step_line(step: int, total: int, row: Mapping[str, Scalar]) -> str:
    """The plain one-line summary of a step: step, reward mean/std, loss, step time and the phase times."""
    phases = [(key[len("time_"):-len("_s")], value) for key, value in row.items()
              if key.startswith("time_") and key.endswith("_s") and key != "time_step_s"]
    times = " ".join(f"{name}={float(value):.2f}s" for name, value in phases)
    line = (f"step {step}/{total} reward_mean={float(row['reward_mean']):.4g} "
            f"reward_std={float(row['reward_std']):.4g} loss={float(row['loss']):.4g} "
            f"step_time={float(row['time_step_s']):.2f}s")
    return f"{line} ({times})" if times else line


class ProgressBar:
    """Rank 0's progress output; silent elsewhere or when disabled (``logging.progress_bar=false``).

    On a terminal: a step bar with the latest numbers and under it a rollout bar that advances with every
    denoising step of every group the rank rolls out (:meth:`rollout`, the step engine's progress hook).
    Otherwise (a log file, a pipe): one plain line per step (:func:`step_line`) and no ``\\r`` frames.
    """

    def __init__(self, total: int, initial: int, *, enabled: bool, stream: Any = None) -> None:
        """``stream``: where the output goes (default ``sys.stderr``)."""
        self.total = total
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.interactive = enabled and is_terminal(self.stream)
        self._bar = self._rollout_bar = None
        self._redirect = contextlib.ExitStack()
        if self.interactive:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                             file=self.stream, position=0)
            self._rollout_bar = tqdm(total=0, desc="rollout", unit="step", dynamic_ncols=True, file=self.stream,
                                     position=1, leave=False)
            # Log lines (checkpoints saved, warnings) are printed above the bars instead of through them.
            self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger(LOGGER_NAME)], tqdm_class=tqdm))

    @property
    def rollout_hook(self) -> Optional[Callable[[int, int], None]]:
        """The step engine's progress callback: :meth:`rollout` on a terminal, else None (no per-step cost)."""
        return self.rollout if self._rollout_bar is not None else None

    def rollout(self, done: int, total: int) -> None:
        """``done`` of the step's ``total`` denoising steps (over this rank's groups) are rolled out."""
        bar = self._rollout_bar
        if bar is None:
            return
        if done <= 1 or bar.total != total or done < bar.n:
            bar.reset(total=total)
        bar.update(done - bar.n)
        if done == total:
            bar.refresh()  # tqdm skips frames closer than its mininterval: always show the finished rollout

    def update(self, step: int, row: Mapping[str, Scalar]) -> None:
        """Step ``step`` finished with metrics ``row`` (the row written to metrics.jsonl)."""
        if not self.enabled:
            return
        if self._bar is None:
            self.stream.write(step_line(step, self.total, row) + "\n")
            self.stream.flush()
            return
        self._bar.set_postfix_str(f"reward={float(row['reward_mean']):.4g} std={float(row['reward_std']):.3g} "
                                  f"loss={float(row['loss']):.4g} t={float(row['time_step_s']):.2f}s", refresh=False)
        self._bar.update(1)
        self._bar.refresh()

    def close(self) -> None:
        """Close the bars (and give the log its own handler back)."""
        self._redirect.close()
        for bar in (self._rollout_bar, self._bar):
            if bar is not None:
                bar.close()
        self._bar = self._rollout_bar = None
