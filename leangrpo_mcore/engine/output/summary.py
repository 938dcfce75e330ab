"""The lines a finished run prints: steps, the reward's first and last value, the step time, where things are."""

from __future__ import annotations

import os

from leangrpo_mcore.engine import checkpoint
from leangrpo_mcore.engine.output.run_dir import RunDir, read_metrics


def run_summary(run_dir: RunDir, head: str, step_times: list[float], *, tensorboard: bool) -> str:
    """``head`` and the run's summary: the first and last ``reward_mean`` of ``metrics.jsonl``, the mean of this
    launch's ``step_times``, the samples folder, TensorBoard's command and the last complete checkpoint with its
    export command."""
    rows = read_metrics(run_dir.metrics_path)
    rewards = [r["reward_mean"] for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    lines = [head]
    if rewards:
        lines.append(f"reward: first {rewards[0]:.4f} -> last {rewards[-1]:.4f} (change {rewards[-1] - rewards[0]:+.4f})")
    if step_times:
        lines.append(f"mean step time: {sum(step_times) / len(step_times):.2f} s over {len(step_times)} steps this "
                     "launch")
    lines.append(f"samples: {run_dir.samples_dir}")
    if tensorboard:
        lines.append(f"tensorboard: tensorboard --logdir {run_dir.tensorboard_dir}")
    complete = checkpoint.list_complete(run_dir)
    if complete:
        latest = complete[-1][1]
        lines.append(f"checkpoint: {latest} (export: leangrpo-convert mcore-to-diffusers --src {latest} "
                     f"--dst {os.path.join(run_dir.root, 'diffusers')})")
    return "\n".join(lines)
