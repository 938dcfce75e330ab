"""Config drift on resume: which keys of a resumed run differ from the checkpoint's, and which of them matter.

A resumed run continues the uninterrupted one only when every step computes what it would have computed. Keys
that only say how the run is carried out (the optimizer's settings, the length of the run, logging, evaluation,
checkpointing, the parallel layout, the reward server's transport, where the weights were read from) may change
and are applied; any other key (group size, denoising steps, sampler, schedule, prompts per step, reward,
seeds, dtypes, ...) changes what a step computes and is refused unless ``train.allow_config_change`` is set. A
key this module does not list is refused: a new option is assumed to matter until it is classified here.

This module imports no torch; the history of a run's configs is written by :func:`record_launch_config`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from leangrpo_mcore.config.loader import config_to_yaml, section_type
from leangrpo_mcore.config.schema import Config
from leangrpo_mcore.errors import UserError

APPLIED_PREFIXES = ("optim.", "checkpoint.", "logging.", "eval.", "parallel.")
"""Sections whose every key may change on resume: none of them changes what a training step computes
(``optim.name`` is checked separately, as the checkpoint's optimizer state must fit; a layout change reshards)."""

APPLIED_KEYS = frozenset({
    "train.max_steps", "train.output_dir", "train.overwrite", "train.max_nonfinite_skips",
    "train.allow_config_change",
    "reward.url", "reward.timeout_s", "reward.retries", "reward.max_response_bytes", "reward.auth_env",
    "reward.ca_bundle", "reward.async_scoring",
    "model.path", "model.random_init", "model.seed", "model.backend", "model.activation_checkpointing",
    "data.prompts",
})
"""Single keys that may change on resume. ``model.path`` and ``model.seed`` only choose the weights that the
checkpoint's replace; ``data.prompts`` may name a moved file, as its content is compared by fingerprint."""

SILENT_KEYS = frozenset({"checkpoint.resume"})
"""Keys that differ on nearly every resume (null in the first launch): applied without a log line."""

PROMPTS_CONTENT = "data.prompts (content)"
"""The pseudo-key under which a changed prompt dataset (another fingerprint) is reported."""


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between the checkpoint's config and this run's."""

    key: str
    """Dotted key (or :data:`PROMPTS_CONTENT`)."""
    before: Any
    """The checkpoint's value (plain YAML data)."""
    after: Any
    """This run's value (plain YAML data)."""
    applied: bool
    """True when the change keeps the run's steps as they were (it is applied without asking)."""

    def describe(self) -> str:
        """``key (before -> after)``."""
        return f"{self.key} ({self.before!r} -> {self.after!r})"


def is_applied(key: str) -> bool:
    """Whether a change of ``key`` keeps what every training step computes."""
    return key in APPLIED_KEYS or key.startswith(APPLIED_PREFIXES)


def config_changes(saved: dict, config: Config, *, saved_fingerprint: Optional[str] = None,
                   fingerprint: Optional[str] = None, planned: frozenset[str] = frozenset()) -> list[ConfigChange]:
    """Every key of ``config`` whose value differs from ``saved`` (the checkpoint's config as a mapping), sorted.

    Keys that ``saved`` lacks (a checkpoint of an earlier version) are not compared. With both fingerprints
    given, a prompt dataset whose content differs is a refused :data:`PROMPTS_CONTENT` change; without the saved
    one (an older checkpoint), a changed ``data.prompts`` path is refused instead. ``planned`` names the keys
    the user left ``auto`` and the layout planner resolved at launch (a schedule among equivalent ones, the
    layout): a different resolution is applied, not refused.
    """
    mine = yaml.safe_load(config_to_yaml(config))
    changes = [ConfigChange(key, before, after, is_applied(key) or key in planned)
               for key, before, after in _differences(Config, saved, mine, prefix="")
               if key not in SILENT_KEYS]
    if saved_fingerprint is not None and fingerprint is not None:
        if saved_fingerprint != fingerprint:
            changes.append(ConfigChange(PROMPTS_CONTENT, saved_fingerprint, fingerprint, applied=False))
    else:
        changes = [dataclasses.replace(c, applied=False) if c.key == "data.prompts" else c for c in changes]
    return sorted(changes, key=lambda c: c.key)


def _differences(cls: type, saved: dict, mine: dict, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, this run's value) of every differing leaf of the config class ``cls``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in saved:
            continue
        dotted, before, after = f"{prefix}{f.name}", saved[f.name], mine.get(f.name)
        section = section_type(hints[f.name])
        if section is not None and isinstance(before, dict) and isinstance(after, dict):
            out.extend(_differences(section, before, after, dotted + "."))
        elif before != after:
            out.append((dotted, before, after))
    return out


def refusal(path: str, refused: list[ConfigChange]) -> str:
    """The one-line error of a resume whose config changes what a step computes."""
    keys = ", ".join(c.describe() for c in refused)
    return (f"resuming {path} with a config that changes what a training step computes: {keys}; restore these "
            f"keys, or set train.allow_config_change=true to continue with the changed settings")


def record_launch_config(root: str, step: int, config_yaml: str) -> str:
    """Write ``root/configs/config_step_<step>.yaml`` (the config of the launch starting after ``step``).

    A fresh run (``step`` 0) starts the history anew; a second launch from the same step keeps the first one's
    file and adds ``config_step_<step>_<k>.yaml``. Returns the path written (or the identical file found);
    UserError naming the file when it cannot be written.
    """
    try:
        return _write_history(os.path.join(root, "configs"), step, config_yaml)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or root}: {err.strerror}") from None


def _write_history(folder: str, step: int, config_yaml: str) -> str:
    """:func:`record_launch_config` in ``folder``."""
    if step == 0 and os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("config_step_") and name.endswith(".yaml"):
                os.remove(os.path.join(folder, name))
    os.makedirs(folder, exist_ok=True)
    path, k = os.path.join(folder, f"config_step_{step}.yaml"), 0
    while os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            if fh.read() == config_yaml:
                return path
        k += 1
        path = os.path.join(folder, f"config_step_{step}_{k}.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(config_yaml)
    os.replace(tmp, path)
    return path
