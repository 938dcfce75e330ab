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
anything is written (``train.overwrite: true`` deletes them instead). A resumed run cuts ``metrics.jsonl`` before
its first row past the checkpoint's step, so that it reads exactly as if the run had never been interrupted; what
stays is kept byte for byte (a malformed line is kept, reported with its line number and skipped by readers).
Every failure to write a file of the run directory is one :class:`~leangrpo_mcore.errors.UserError` line naming
the file, and leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

from leangrpo_mcore.engine.launch import get_logger
from leangrpo_mcore.errors import UserError

MARKER = "COMPLETE"
"""The file a checkpoint directory holds once it is complete (written last; its content is the checkpoint's
manifest, :mod:`~leangrpo_mcore.engine.checkpoint.manifest`)."""
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
    # A complete copy caught between the renames of its publication is a checkpoint too.
    found = [name for name in run_dir.existing_checkpoints()
             if STEP_DIR.match(name) or is_complete(os.path.join(run_dir.checkpoints_dir, name))]
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


def prepare(run_dir: RunDir, config_yaml: str, *, resume_step: Optional[int],
            warn: Optional[Callable[[str], None]] = None) -> None:
    """Create the directory tree, write ``config.yaml``, cut ``metrics.jsonl`` back to ``resume_step`` and drop
    unfinished checkpoint writes (rank 0).

    ``resume_step`` is the step of the checkpoint being resumed, or None for a fresh run (which starts an empty
    metrics file: a fresh run reaches here only when the directory holds no checkpoint). ``warn`` (the project
    logger by default) reports the malformed lines kept in the metrics.
    """
    warn = warn or get_logger().warning
    # Unfinished writes go first: after a full disk they are what frees the space the new files need.
    remove_unfinished(run_dir)
    for path in (run_dir.root, run_dir.checkpoints_dir, run_dir.samples_dir):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create train.output_dir '{path}': {err.strerror}") from None
    try:
        write_text_atomic(run_dir.config_path, config_yaml)
        truncate_metrics(run_dir.metrics_path, resume_step or 0, warn)
        truncate_metrics(run_dir.eval_path, resume_step or 0, warn)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or run_dir.root}: {err.strerror}") from None


def remove_unfinished(run_dir: RunDir) -> list[str]:
    """Delete what interrupted writes left behind: the temporary files of atomic writes in the run directory and
    the ``step_<N>.tmp-*`` directories of interrupted saves.

    A ``.tmp-`` directory that holds a ``COMPLETE`` marker is a finished checkpoint caught between the renames
    that publish it; it is deleted only when a complete ``step_<N>`` exists beside it, and kept otherwise
    (:func:`~leangrpo_mcore.engine.checkpoint.resume.restore_interrupted` puts it back in place).
    """
    removed = []
    if os.path.isdir(run_dir.root):
        for name in os.listdir(run_dir.root):
            if ".tmp-" in name and os.path.isfile(os.path.join(run_dir.root, name)):
                os.remove(os.path.join(run_dir.root, name))
                removed.append(os.path.join(run_dir.root, name))
    for name in run_dir.existing_checkpoints():
        match = STEP_ANY.match(name)
        if STEP_DIR.match(name) or (is_complete(os.path.join(run_dir.checkpoints_dir, name))
                                    and not is_complete(run_dir.checkpoint_path(int(match.group(1))))):
            continue
        path = os.path.join(run_dir.checkpoints_dir, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def is_complete(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory with its ``COMPLETE`` marker (not yet verified)."""
    return os.path.isfile(os.path.join(path, MARKER))


def write_failure(path: str, err: OSError) -> UserError:
    """The one-line error of a failed write of ``path`` (the OS's reason, without errno or traceback)."""
    return UserError(f"cannot write {path}: {err.strerror or err}")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a half-written file); a failure
    is a UserError naming ``path`` and leaves no temporary file."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str, data: bytes) -> None:
    """:func:`write_text_atomic` for bytes."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_failure(path, err) from None


@dataclass(frozen=True)
class JsonLines:
    """A JSON-lines file as read: its rows, their line numbers and the lines that are not JSON objects."""

    rows: list[dict]
    """The JSON objects, in file order."""
    row_lines: list[int]
    """1-based line number of each row."""
    lines: list[bytes]
    """Every line as it is on disk, newline included (the torn last line too)."""
    malformed: list[int]
    """1-based numbers of the lines that are not JSON objects, a torn last line excluded."""
    torn: bool
    """The last line lacks its newline and is not JSON: a write cut short (a kill, a full disk)."""


def read_jsonl(path: str) -> JsonLines:
    """Read ``path`` line by line; a malformed line is recorded (never the end of the read) and the rows after it
    are kept."""
    if not os.path.isfile(path):
        return JsonLines([], [], [], [], False)
    with open(path, "rb") as fh:
        parts = fh.read().split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    rows, row_lines, malformed, torn = [], [], [], False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            value = None
        if isinstance(value, dict):
            rows.append(value)
            row_lines.append(number)
        elif number == len(lines) and not line.endswith(b"\n"):
            torn = True
        else:
            malformed.append(number)
    return JsonLines(rows, row_lines, lines, malformed, torn)


def read_metrics(path: str) -> list[dict]:
    """The JSON rows of a metrics file; malformed lines and a torn last line (a kill mid-write) are skipped."""
    return read_jsonl(path).rows


def _row_step(row: dict) -> Optional[int]:
    try:
        return int(row.get("step"))
    except (TypeError, ValueError):
        return None


def truncate_metrics(path: str, last_step: int, warn: Optional[Callable[[str], None]] = None) -> int:
    """Cut ``path`` before its first row past ``last_step``; returns how many rows were dropped.

    What stays is kept byte for byte, malformed lines included (each reported through ``warn`` with the file
    and line number, and skipped by every reader): the file is never rewritten from what could be parsed. A
    torn last line is dropped; a last row without its newline gets one, so that the next row starts a line.
    """
    read = read_jsonl(path)
    cut = len(read.lines) - (1 if read.torn else 0)
    for row, number in zip(read.rows, read.row_lines):
        step = _row_step(row)
        if step is not None and step > last_step:
            cut = number - 1
            break
    kept = read.lines[:cut]
    for number in read.malformed:
        if number <= cut and warn is not None:
            warn(f"{path}:{number}: not a JSON object; the line is kept as it is and skipped")
    if kept and not kept[-1].endswith(b"\n"):
        kept[-1] += b"\n"
    if kept != read.lines:
        write_bytes_atomic(path, b"".join(kept))
    return sum(1 for number in read.row_lines if number > cut)


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON object as a line of ``path`` (flushed to disk); a failure is a UserError naming ``path``."""
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:
        raise write_failure(path, err) from None
