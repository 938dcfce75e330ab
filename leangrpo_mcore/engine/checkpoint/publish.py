"""Publishing a written checkpoint: each rank checksums its own files, rank 0 writes the ``COMPLETE`` marker and
renames ``step_<N>.tmp-<id>`` into place; and pruning the old ones.

The whole write goes into ``step_<N>.tmp-<id>`` and is renamed into place after the marker, so a crash mid-save
leaves only a ``.tmp-`` directory that resume never picks and the next launch removes. A crash after the marker
(before the rename, or between the two renames that replace an existing ``step_<N>``) leaves a complete copy under
a ``.tmp-`` name: ``checkpoint.resume=auto`` puts it back in place
(:func:`~leangrpo_mcore.engine.checkpoint.resume.restore_interrupted`) and nothing deletes it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Optional

import torch.distributed as dist

from leangrpo_mcore.engine.checkpoint import manifest
from leangrpo_mcore.engine.checkpoint.format import fsync_file, list_complete, rank, world
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.checkpoint import DCP_DIR


def write_error(tmp: str, err: BaseException) -> UserError:
    """The one-line error of a failed write, naming the file where the OS said which."""
    seen, found = [err], None
    while seen:
        exc = seen.pop()
        if isinstance(exc, OSError):
            found = exc
            break
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):  # DCP: {rank: (exception, traceback summary)}
            for value in failures.values():
                value = value[0] if isinstance(value, tuple) and value else value
                if isinstance(value, BaseException):
                    seen.append(value)
        for nxt in (exc.__cause__, exc.__context__):
            if nxt is not None:
                seen.append(nxt)
    if found is not None:
        where = found.filename or tmp
        return UserError(f"cannot write checkpoint: {where}: {found.strerror or found}")
    lines = str(err).strip().splitlines()
    return UserError(f"cannot write checkpoint {tmp}: {type(err).__name__}: {lines[-1] if lines else ''}")


def _broadcast(obj: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """``obj`` of rank 0 on every rank of ``group`` (the default group for None)."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def complete(tmp: str, final: str, step: int, error: Optional[UserError],
              group: Optional[dist.ProcessGroup]) -> str:
    """Collective over ``group``: checksum each rank's files, write the marker and rename ``tmp`` into place
    (rank 0); returns ``final`` or raises the first rank's UserError on every rank (``tmp`` removed)."""
    files: dict[str, dict] = {}
    if error is None:
        try:
            files = manifest.describe(tmp, _own_files(tmp, rank()))
        except OSError as err:
            error = write_error(tmp, err)
    gathered = [(None if error is None else str(error), files)]
    if world() > 1:
        gathered = [None] * world()
        dist.all_gather_object(gathered, (None if error is None else str(error), files), group=group)
    problems = [e for e, _ in gathered if e]
    if problems:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(problems[0])
    outcome: Optional[str] = None
    if rank() == 0:
        try:
            merged = {rel: entry for _, part in gathered for rel, entry in part.items()}
            missing = sorted(set(manifest.files_under(tmp)) - set(merged))
            merged.update(manifest.describe(tmp, missing))
            manifest.write_marker(tmp, step, merged)
            _publish(tmp, final)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = str(write_error(tmp, err))
    outcome = _broadcast(outcome, group)
    if outcome:
        raise UserError(outcome)
    return final


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into ``tmp`` (DCP names its data files ``__<rank>_<n>.distcp``)."""
    mine = [f"rng/rank_{rank}.pt"]
    folder = os.path.join(tmp, DCP_DIR)
    if os.path.isdir(folder):
        mine += [f"{DCP_DIR}/{name}" for name in sorted(os.listdir(folder)) if name.startswith(f"__{rank}_")]
    return mine


def _publish(tmp: str, final: str) -> None:
    fsync_file(tmp)
    if os.path.exists(final):
        # Re-saving a step (a run resumed from an older checkpoint): move the old one aside, then drop it.
        trash = f"{final}.tmp-replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_file(os.path.dirname(final))


def prune(run_dir: RunDir, keep_last: int, newest: Optional[str] = None) -> list[str]:
    """Rank 0: delete all but ``keep_last`` checkpoints (0 keeps all); returns the deleted.

    ``newest`` (the checkpoint just written) is always kept, whatever its step: a run resumed from an older
    checkpoint must not lose its own latest state to checkpoints of the timeline it abandoned.
    """
    if keep_last <= 0:
        return []
    others = [path for _, path in list_complete(run_dir) if path != newest]
    keep = keep_last - (1 if newest is not None else 0)
    doomed = others[:len(others) - keep] if keep > 0 else others
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
