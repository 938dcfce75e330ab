"""The run directory ``train.output_dir`` and its rules.

Layout::

    OUTPUT_DIR/
      config.yaml            the resolved config of the latest launch
      metrics.jsonl          one JSON object per optimizer step
      checkpoints/step_<N>/  complete checkpoints (``step_<N>.tmp-*`` are unfinished writes, never resumed)
      samples/step_<N>.png   image grids captioned with prompt and reward (the first frame of a video)
      samples/step_<N>.mp4   video grids of the same samples (policies with sampler.frames > 1)
      tensorboard/           event files
      wandb_run_id, wandb/   the wandb run's id and files (with logging.wandb; WANDB_DIR moves the files)

A fresh run (``checkpoint.resume: null``) refuses a directory that already holds checkpoints or metrics, before
anything is written (``train.overwrite: true`` deletes them instead). A resumed run drops the metrics rows past the checkpoint's step, so ``metrics.jsonl`` reads exactly as if
the run had never been interrupted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional

from leangrpo_mcore.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")
STEP_ANY = re.compile(r"^step_(\d+)(\.tmp-.*)?$")


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory."""

    root: str
    """train.output_dir."""

    @property
    def config_path(self) -> str:
        """The resolved config."""
        return os.path.join(self.root, "config.yaml")

    @property
    def metrics_path(self) -> str:
        """Per-step metrics, one JSON object per line."""
        return os.path.join(self.root, "metrics.jsonl")

    @property
    def eval_path(self) -> str:
        """``eval.jsonl``: one JSON object per evaluation."""
        return os.path.join(self.root, "eval.jsonl")

    @property
    def checkpoints_dir(self) -> str:
        """Parent of the step_<N> checkpoints."""
        return os.path.join(self.root, "checkpoints")

    @property
    def samples_dir(self) -> str:
        """Parent of the step_<N>.png / .mp4 sample grids."""
        return os.path.join(self.root, "samples")

    @property
    def tensorboard_dir(self) -> str:
        """TensorBoard event files."""
        return os.path.join(self.root, "tensorboard")

    def checkpoint_path(self, step: int) -> str:
        """Directory of the checkpoint of ``step``."""
        return os.path.join(self.checkpoints_dir, f"step_{step}")

    def sample_path(self, step: int, prefix: str = "step") -> str:
        """Image grid of ``step``: ``samples/<prefix>_<step>.png`` (e.g. ``prefix="eval_step"`` for evaluations)."""
        return os.path.join(self.samples_dir, sample_name(step, prefix, "png"))

    def video_path(self, step: int, prefix: str = "step") -> str:
        """Video grid of ``step``: ``samples/<prefix>_<step>.mp4``."""
        return os.path.join(self.samples_dir, sample_name(step, prefix, "mp4"))

    def existing_checkpoints(self) -> list[str]:
        """Names of every checkpoint entry, complete or not (``step_<N>`` and ``step_<N>.tmp-*``), sorted."""
        if not os.path.isdir(self.checkpoints_dir):
            return []
        return sorted(name for name in os.listdir(self.checkpoints_dir) if STEP_ANY.match(name))


def sample_name(step: int, prefix: str, extension: str) -> str:
    """The file name of a sample grid: ``<prefix>_<step>.<extension>``."""
    if not prefix or os.sep in prefix or "." in prefix:
        raise ValueError(f"sample prefix must be a plain name without '.' or '{os.sep}', got {prefix!r}")
    return f"{prefix}_{int(step)}.{extension}"


def check_fresh_run(run_dir: RunDir, *, overwrite: bool = False) -> None:
    """UserError when a fresh run would write into a directory that holds an earlier run's checkpoints or
    metrics; with ``overwrite`` those (and its samples and TensorBoard events) are deleted instead."""
    if os.path.exists(run_dir.root) and not os.path.isdir(run_dir.root):
        raise UserError(f"train.output_dir '{run_dir.root}' exists and is not a directory")
    found = [name for name in run_dir.existing_checkpoints() if STEP_DIR.match(name)]
    has_metrics = os.path.isfile(run_dir.metrics_path) and os.path.getsize(run_dir.metrics_path) > 0
    if not found and not has_metrics:
        return
    if overwrite:
        for path in (run_dir.checkpoints_dir, run_dir.samples_dir, run_dir.tensorboard_dir):
            shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(run_dir.metrics_path):
            os.remove(run_dir.metrics_path)
        return
    what = f"checkpoints ({found[-1]})" if found else "the metrics of an earlier run (metrics.jsonl)"
    raise UserError(
        f"train.output_dir '{run_dir.root}' already holds {what}; set checkpoint.resume=auto to continue that "
        f"run, train.overwrite=true to replace it, or choose another train.output_dir"
    )


def prepare(run_dir: RunDir, config_yaml: str, *, resume_step: Optional[int]) -> None:
    """Create the directory tree, write ``config.yaml``, cut ``metrics.jsonl`` back to ``resume_step`` and drop
    unfinished checkpoint writes (rank 0).

    ``resume_step`` is the step of the checkpoint being resumed, or None for a fresh run (which starts an empty
    metrics file: a fresh run reaches here only when the directory holds no checkpoint).
    """
    # Unfinished writes go first: after a full disk they are what frees the space the new files need.
    remove_unfinished(run_dir)
    for path in (run_dir.root, run_dir.checkpoints_dir, run_dir.samples_dir):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create train.output_dir '{path}': {err.strerror}") from None
    try:
        write_text_atomic(run_dir.config_path, config_yaml)
        truncate_metrics(run_dir.metrics_path, resume_step or 0)
        truncate_metrics(run_dir.eval_path, resume_step or 0)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or run_dir.root}: {err.strerror}") from None


def remove_unfinished(run_dir: RunDir) -> list[str]:
    """Delete the ``step_<N>.tmp-*`` directories that interrupted saves left behind (never resumable), and the
    temporary files of interrupted atomic writes in the run directory."""
    removed = []
    if os.path.isdir(run_dir.root):
        for name in os.listdir(run_dir.root):
            if ".tmp-" in name and os.path.isfile(os.path.join(run_dir.root, name)):
                os.remove(os.path.join(run_dir.root, name))
                removed.append(os.path.join(run_dir.root, name))
    for name in run_dir.existing_checkpoints():
        if not STEP_DIR.match(name):
            path = os.path.join(run_dir.checkpoints_dir, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a half-written file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    """The JSON rows of a metrics file; a torn last line (a kill mid-write) is ignored."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep only the rows with ``step <= last_step``; returns how many rows were dropped."""
    rows = read_metrics(path)
    kept = [row for row in rows if int(row.get("step", 0)) <= last_step]
    if os.path.isfile(path) or kept:
        write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(rows) - len(kept)


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON object as a line of ``path`` (flushed to disk)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
