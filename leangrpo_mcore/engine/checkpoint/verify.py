"""Verifying a training checkpoint before anything reads it: one path for every reader.

Resume (``checkpoint.resume``), ``model.path=RUN/checkpoints/step_<N>``, ``leangrpo-eval --checkpoint`` and
``leangrpo-convert mcore-to-diffusers --src`` all call :func:`verify_before_reading`: the ``COMPLETE`` marker's
sizes and CRC-32s are checked with each rank reading its share of the bytes
(:func:`~leangrpo_mcore.engine.checkpoint.manifest.verify_on_ranks`), and a checkpoint without its marker, or with a
file that does not match it, is refused in one :class:`~leangrpo_mcore.errors.UserError` line that names the
reader's key, the checkpoint and the file. A policy or diffusers directory (no marker, no ``dcp/``, no trainer
state) is not a training checkpoint and is read as before. ``checkpoint.verify: false`` (``leangrpo-convert
--no-verify``) skips the check on purpose, said in one log line; a read error is then still one line
(:func:`~leangrpo_mcore.models.common.dcp_source.dcp_failure`), but altered bytes go unnoticed.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from leangrpo_mcore.engine.checkpoint import manifest
from leangrpo_mcore.engine.launch import get_logger
from leangrpo_mcore.errors import UserError

STATE_FILE = "trainer_state.json"
DCP_DIR = "dcp"


def is_training_checkpoint(path: str) -> bool:
    """Whether the directory ``path`` is (or was meant to be) a training checkpoint: it holds the ``COMPLETE``
    marker, the trainer state or sharded ``dcp/`` weights, which a policy or diffusers directory never does."""
    return any(os.path.exists(os.path.join(path, name)) for name in (manifest.MARKER, STATE_FILE, DCP_DIR))


def problem_words(path: str, problem: str) -> str:
    """``<path> <what is wrong>`` for a verification ``problem`` phrase of the manifest."""
    if problem == f"no {manifest.MARKER} marker":
        return (f"{path} is not a complete checkpoint (no {manifest.MARKER} marker: a save or copy that did not "
                f"finish)")
    return f"{path} fails verification: {problem}"


def verify_before_reading(path: str, key: str, *, enabled: bool = True, log: Optional[logging.Logger] = None,
                          switch: str = "checkpoint.verify=false", required: bool = False) -> None:
    """Collective over the default group when it exists (every rank calls it): a UserError ``<key>: <path> ...``
    unless the training checkpoint at ``path`` has its marker and every file matches it. A directory that is no
    training checkpoint passes, unless ``required`` (a reader that takes nothing else). ``enabled`` False (the
    setting ``switch``): one line through ``log`` (the project logger by default), no check."""
    if not os.path.isdir(path) or not (required or is_training_checkpoint(path)):
        return
    if not enabled:
        (log or get_logger()).warning("%s: %s is read without checking it against its %s marker (%s)", key, path,
                                      manifest.MARKER, switch)
        return
    problem = manifest.verify_on_ranks(path)
    if problem is not None:
        raise UserError(f"{key}: {problem_words(path, problem)}")
