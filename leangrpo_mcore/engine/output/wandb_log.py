"""Weights & Biases logging of a run (the ``wandb`` extra), next to metrics.jsonl and TensorBoard.

``logging.wandb: {project, entity, mode}`` turns it on; rank 0 logs the same scalars as TensorBoard, the
sample grids as images and the video grids (``samples/step_<N>.mp4``) as videos. The wandb run id is kept in
``OUTPUT_DIR/wandb_run_id``: a resumed run (``checkpoint.resume``) continues that wandb run (``resume="allow"``),
a fresh run starts a new one. wandb writes its files under ``OUTPUT_DIR/wandb`` unless ``WANDB_DIR`` names
another folder; ``mode: offline`` needs no network (``wandb sync`` uploads the run later). Steps that a killed
run had logged past the checkpoint it resumes from are logged again, and wandb keeps the first value of a step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import string
from typing import Any, Mapping, Optional

from leangrpo_mcore.config.schema import Config
from leangrpo_mcore.engine.launch import get_logger, raise_if_any
from leangrpo_mcore.engine.output.run_dir import write_text_atomic
from leangrpo_mcore.errors import UserError, require_extra

RUN_ID_FILE = "wandb_run_id"
_ID_ALPHABET = string.ascii_lowercase + string.digits


def run_id_path(run_root: str) -> str:
    """Where the wandb run id of a run directory is kept."""
    return os.path.join(run_root, RUN_ID_FILE)


def resolve_run_id(run_root: str, *, resumed: bool) -> str:
    """The id stored in the run directory when ``resumed`` (and there is one), else a new one; stored either way
    (a failed read or write is a UserError naming the file)."""
    path = run_id_path(run_root)
    if resumed and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                run_id = fh.read().strip()
        except OSError as err:
            raise UserError(f"cannot read {path}: {err.strerror}") from None
        if run_id and all(c in _ID_ALPHABET + "-_" for c in run_id):
            return run_id
    run_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    write_text_atomic(path, run_id + "\n")
    return run_id


class WandbRun:
    """An open wandb run: scalars, images and videos at a step, then :meth:`close`."""

    def __init__(self, wandb: Any, run: Any) -> None:
        self._wandb = wandb
        self._run = run
        self.files = os.path.dirname(str(run.dir))
        """Where the run's files are (what a failed write names)."""

    @property
    def id(self) -> str:
        """The wandb run id."""
        return str(self._run.id)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """Every finite number of ``row`` (keys as in TensorBoard: dots become slashes) at ``step``."""
        scalars = {key.replace(".", "/"): value for key, value in row.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value)}
        if scalars:
            self._run.log(scalars, step=int(step))

    def log_image(self, tag: str, image_hwc_uint8: Any, step: int) -> None:
        """An (H, W, 3) uint8 image at ``step``."""
        self._run.log({tag: self._wandb.Image(image_hwc_uint8)}, step=int(step))

    def log_video(self, tag: str, path: str, step: int, fps: int) -> None:
        """The mp4 file at ``path`` as a video played at ``fps`` frames per second, at ``step``."""
        self._run.log({tag: self._wandb.Video(path, fps=int(fps), format="mp4")}, step=int(step))

    def close(self) -> None:
        """Finish the run (flushes an offline run's files)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def _open(wandb: Any, config: Config, run_root: str, resumed: bool) -> WandbRun:
    section = config.logging.wandb
    run_id = resolve_run_id(run_root, resumed=resumed)
    try:
        run = wandb.init(project=section.project, entity=section.entity, mode=section.mode, id=run_id,
                         resume="allow", name=os.path.basename(os.path.normpath(run_root)),
                         dir=os.environ.get("WANDB_DIR") or run_root, config=dataclasses.asdict(config),
                         settings=wandb.Settings(console="off"))
    except Exception as exc:  # noqa: BLE001 -- login, network and permission failures of wandb are one line
        text = " ".join(str(exc).split())
        raise UserError(f"logging.wandb: wandb.init failed: {type(exc).__name__}: {text}") from None
    opened = WandbRun(wandb, run)
    get_logger().info("wandb run %s (%s), files in %s", run.id, section.mode, opened.files)
    return opened


def open_wandb(config: Config, run_root: str, *, resumed: bool, enabled: bool) -> Optional[WandbRun]:
    """The wandb run of ``config.logging.wandb`` opened on the rank that is ``enabled`` (rank 0), else None (also
    for no section and for ``mode: disabled``, which need no wandb).

    Collective when the section is set: every rank checks that wandb is installed (a one-line error naming the
    extra), and a failure to open the run on rank 0 is raised on every rank.
    """
    if config.logging.wandb is None or config.logging.wandb.mode == "disabled":
        return None
    wandb = require_extra("wandb", "wandb", "logging.wandb")
    error: Optional[str] = None
    run: Optional[WandbRun] = None
    if enabled:
        try:
            run = _open(wandb, config, run_root, resumed)
        except UserError as err:
            error = str(err)
    raise_if_any(error)
    return run
