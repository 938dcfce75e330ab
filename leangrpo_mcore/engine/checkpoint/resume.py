"""Which checkpoint a run resumes: ``checkpoint.resume`` resolved to a verified checkpoint, interrupted publishes
put back in place, damaged checkpoints set aside, a run directory of nothing but damaged ones refused (unless
``fresh_if_damaged`` asks for a fresh start).

Every rank verifies its share of a checkpoint's bytes
(:func:`~leangrpo_mcore.engine.checkpoint.manifest.verify_on_ranks`); rank 0 alone lists and renames, and every
rank gets the same answer (or UserError). Whether the checkpoint fits this run is checked here too: the same
model (:func:`check_compatible`) and the settings that change what a step computes (:func:`compare_configs`).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Optional

from leangrpo_mcore.config import Config
from leangrpo_mcore.config.drift import PROMPTS_CONTENT, config_changes, refusal

from leangrpo_mcore.engine.checkpoint import manifest
from leangrpo_mcore.engine.checkpoint.format import MARKER, list_complete, read_state, saved_config
from leangrpo_mcore.engine.checkpoint.verify import verify_before_reading
from leangrpo_mcore.engine.launch import first_error
from leangrpo_mcore.engine.output.run_dir import STEP_ANY, STEP_DIR, RunDir, is_complete
from leangrpo_mcore.errors import UserError

FRESH_IF_DAMAGED = "fresh_if_damaged"
"""``checkpoint.resume``: as ``auto``, but a run directory whose every checkpoint is damaged starts afresh."""


def set_aside(path: str, final: Optional[str] = None) -> str:
    """Rename a damaged checkpoint to ``<final>.damaged-<id>`` (``final`` defaults to ``path``; kept for
    inspection, never resumed or pruned)."""
    target = f"{final or path}.damaged-{uuid.uuid4().hex[:6]}"
    os.rename(path, target)
    return target


def _interrupted_copies(run_dir: RunDir) -> dict[int, list[str]]:
    """Rank 0: ``{step: complete .tmp- copies, the new write first}`` for each step without a ``step_<N>``."""
    copies: dict[int, list[str]] = {}
    for name in run_dir.existing_checkpoints():
        match = STEP_ANY.match(name)
        if match.group(2) and is_complete(os.path.join(run_dir.checkpoints_dir, name)):
            copies.setdefault(int(match.group(1)), []).append(os.path.join(run_dir.checkpoints_dir, name))
    return {step: sorted(paths, key=lambda p: ".tmp-replaced-" in p) for step, paths in copies.items()
            if not os.path.exists(run_dir.checkpoint_path(step))}


def _restore_or_set_aside(path: str, final: str, problem: Optional[str], warn: Any) -> None:
    """Rank 0: rename a verified copy to ``final``, or set a damaged one aside; one line through ``warn``."""
    say = warn or (lambda message: None)
    try:
        if problem is None:
            os.rename(path, final)
            say(f"checkpoint {final} was complete but not in place (a crash while publishing it); "
                f"restored from {os.path.basename(path)}")
            return
        moved = set_aside(path, final)
    except OSError as err:
        raise UserError(f"cannot restore checkpoint {path}: {err.strerror}") from None
    say(f"checkpoint copy {path} is damaged ({problem}); set aside as {moved}")


def restore_interrupted(run_dir: RunDir, warn: Any = None) -> list[str]:
    """Collective: rename back to ``step_<N>`` each complete checkpoint that a crash left under a ``.tmp-`` name
    (between the renames that publish it, or between its marker and its rename) while no ``step_<N>`` exists;
    returns the restored paths.

    Of two complete copies of a step (the new write and the ``.tmp-replaced-`` copy it was replacing), the new
    one is restored when it verifies, else the other; a copy that fails verification is set aside as
    ``step_<N>.damaged-<id>``. Each is reported in one line through ``warn`` (rank 0); every rank verifies its
    share (:func:`~leangrpo_mcore.engine.checkpoint.manifest.verify_on_ranks`) and rank 0 renames.
    """
    restored = []
    for step, paths in sorted(first_error(_interrupted_copies, run_dir).items()):
        final = run_dir.checkpoint_path(step)
        for path in paths:
            problem = manifest.verify_on_ranks(path)
            first_error(_restore_or_set_aside, path, final, problem, warn)
            if problem is None:
                restored.append(final)
                break
    return restored


AUTO = ("auto", FRESH_IF_DAMAGED)
"""The ``checkpoint.resume`` values that pick the newest checkpoint of the run directory."""


def _newest_first(run_dir: RunDir) -> list[str]:
    return [path for _, path in reversed(list_complete(run_dir))]


def _incomplete(run_dir: RunDir, warn: Any) -> list[str]:
    """Rank 0: the ``step_<N>`` directories without a ``COMPLETE`` marker, oldest first, each named in a warning
    (a save never renames one into place unfinished: a copy or a removal by hand that stopped halfway)."""
    found = []
    for name in run_dir.existing_checkpoints():
        match = STEP_DIR.match(name)
        if match and not is_complete(os.path.join(run_dir.checkpoints_dir, name)):
            found.append((int(match.group(1)), os.path.join(run_dir.checkpoints_dir, name)))
    for _, path in sorted(found):
        if warn is not None:
            warn(f"checkpoint {path} has no {MARKER} marker (a copy or a removal that stopped halfway); it is not "
                 f"resumed")
    return [path for _, path in sorted(found)]


def _newest_unverified(run_dir: RunDir, warn: Any) -> Optional[str]:
    """Rank 0: the newest checkpoint with a marker, resumed unverified (``checkpoint.verify: false``), warned."""
    candidates = _newest_first(run_dir)
    if candidates and warn is not None:
        warn(f"checkpoint.resume: {candidates[0]} is resumed without checking it against its {MARKER} marker "
             f"(checkpoint.verify=false)")
    return candidates[0] if candidates else None


def _set_aside_all(damaged: list[tuple[str, str]], warn: Any, then: str) -> None:
    """Rank 0: set each damaged (path, problem) aside, one warning line each ending with ``then``."""
    for path, problem in damaged:
        try:
            moved = set_aside(path)
        except OSError as err:
            raise UserError(f"checkpoint {path} is damaged ({problem}) and cannot be set aside: "
                            f"{err.strerror}") from None
        if warn is not None:
            warn(f"checkpoint {path} is damaged ({problem}); set aside as {moved}, {then}")


def _nothing_verifies(run_dir: RunDir, damaged: list[tuple[str, str]], incomplete: list[str]) -> UserError:
    found = [f"{os.path.basename(path)}: {problem}" for path, problem in damaged]
    found += [f"{os.path.basename(path)}: no {MARKER} marker" for path in incomplete]
    return UserError(f"checkpoint.resume=auto: no checkpoint in {run_dir.checkpoints_dir} verifies ("
                     f"{'; '.join(found)}); nothing was trained. Copy intact checkpoints back, or start afresh on "
                     f"purpose with checkpoint.resume={FRESH_IF_DAMAGED} (the damaged ones are set aside)")


def _resolve_auto(spec: str, run_dir: RunDir, warn: Any, verify: bool) -> Optional[str]:
    """Collective: :func:`resolve_resume` for ``auto`` and ``fresh_if_damaged``."""
    restore_interrupted(run_dir, warn)
    incomplete = first_error(_incomplete, run_dir, warn)
    if not verify:
        return first_error(_newest_unverified, run_dir, warn)
    damaged: list[tuple[str, str]] = []
    for path in first_error(_newest_first, run_dir):
        problem = manifest.verify_on_ranks(path)
        if problem is None:
            first_error(_set_aside_all, damaged, warn, f"resuming from {os.path.basename(path)}")
            return path
        damaged.append((path, problem))
    if not damaged and not incomplete:
        return None
    if spec == "auto":
        raise _nothing_verifies(run_dir, damaged, incomplete)  # every rank has the same lists
    damaged += [(path, f"no {MARKER} marker") for path in incomplete]
    first_error(_set_aside_all, damaged, warn, f"starting afresh (checkpoint.resume={FRESH_IF_DAMAGED})")
    return None


def _check_resume_path(spec: str) -> None:
    if not os.path.isdir(spec):
        raise UserError(f"checkpoint.resume: no such checkpoint directory: {spec}")


def resolve_resume(spec: Optional[str], run_dir: RunDir, warn: Any = None, *, verify: bool = True) -> Optional[str]:
    """Collective: the checkpoint to resume from: None (fresh), ``auto`` (the newest one that verifies, or None),
    ``fresh_if_damaged`` or a path; the same answer (or UserError) on every rank.

    Under ``auto`` complete checkpoints that a crash left under a ``.tmp-`` name are restored first
    (:func:`restore_interrupted`) and ``step_<N>`` directories without a marker are named in a warning; newer
    checkpoints that fail verification are set aside with a one-line ``warn`` (rank 0) each once an older one
    verifies. When none verifies (every checkpoint damaged or incomplete) ``auto`` stops with one line instead of
    starting afresh, and ``fresh_if_damaged`` sets the damaged and incomplete ones aside and starts afresh. An explicit path that
    fails verification is a UserError naming the damaged file. Each rank verifies its share of the bytes
    (:func:`~leangrpo_mcore.engine.checkpoint.verify.verify_before_reading`); rank 0 alone lists and renames.
    ``verify`` False (``checkpoint.verify: false``) skips the verification, with a warning.
    """
    if spec is None:
        return None
    if spec in AUTO:
        return _resolve_auto(spec, run_dir, warn, verify)
    first_error(_check_resume_path, spec)
    verify_before_reading(spec, "checkpoint.resume", enabled=verify, required=True)
    return spec


def check_compatible(path: str, mine: dict, log: logging.Logger) -> bool:
    """UserError unless the checkpoint trains the same model as the layout record ``mine`` (the trainer's
    ``trainer_state.json`` record of this run); False when it was written at another layout."""
    saved = read_state(path)
    for key in ("family", "model_config", "lora", "optimizer"):
        if saved.get(key) != mine[key]:
            raise UserError(f"checkpoint {path} is incompatible with this config: its {key} is "
                            f"{saved.get(key)!r}, this run has {mine[key]!r}")
    # Checkpoints written before context or pipeline parallelism existed ran at cp = pp = 1.
    same = all(saved.get(k, 1 if k in ("cp", "pp") else None) == mine[k]
               for k in ("world_size", "tp", "cp", "pp", "dp_shard", "dp_replicate"))
    if not same:
        log.info("resharding checkpoint written at world size %s (tp %s) to world size %s (tp %s); "
                 "per-rank RNG states are not restored", saved.get("world_size"), saved.get("tp"),
                 mine["world_size"], mine["tp"])
    return same


def compare_configs(path: str, config: Config, *, fingerprint: str, planned: frozenset,
                    log: logging.Logger) -> bool:
    """Compare every key with the checkpoint's config: one log line per change that keeps the steps as they
    were (this run's value applies); UserError naming every key that changes what a step computes, unless
    ``train.allow_config_change``. ``fingerprint``: this run's prompts; ``planned``: the keys the user left auto.
    Returns whether the prompt data changed."""
    saved = saved_config(path)
    if saved is None:
        log.warning("resume: %s holds no readable config.yaml; the config is not compared", path)
        return False
    changes = config_changes(saved, config, saved_fingerprint=read_state(path).get("prompts_fingerprint"),
                             fingerprint=fingerprint, planned=planned)
    refused = [c for c in changes if not c.applied]
    if refused and not config.train.allow_config_change:
        raise UserError(refusal(path, refused))
    for change in changes:
        note = ("the new value applies" if change.applied else
                "applied (train.allow_config_change=true): steps from here differ from the uninterrupted run")
        log.info("resume: %s changed from %r to %r; %s", change.key, change.before, change.after, note)
    return any(c.key in (PROMPTS_CONTENT, "data.shuffle", "train.seed") for c in refused)
