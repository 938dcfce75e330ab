"""A failed write of the run directory's files stops the run on every rank, in one line.

Only rank 0 writes the run directory's files (metrics, samples, TensorBoard, wandb, ``eval.jsonl``); a full disk
or a lost mount there is a :class:`~leangrpo_mcore.errors.UserError` that :meth:`IOFailures.recording` keeps
instead of raising, so that rank 0 does not leave its peers waiting in the next collective. At the next point
where every rank checks (:meth:`IOFailures.stop_if_any`) all of them stop with that line, after the step's
checkpoint is written when one is due (its training is done), and the line says how the save went.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from leangrpo_mcore.engine.launch import raise_if_any
from leangrpo_mcore.errors import UserError


class IOFailures:
    """The first failed write of this rank's run-directory files (see module docstring)."""

    def __init__(self) -> None:
        self.first: Optional[str] = None
        """The first failure's one line (None: every write so far succeeded)."""

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the first UserError raised inside as :attr:`first` instead of raising it."""
        try:
            yield
        except UserError as err:
            self.first = self.first or str(err)

    def stop_if_any(self, step: int, *, save: Optional[Callable[[], object]], finish: Callable[[], None]) -> None:
        """Collective: after a failed write on any rank, stop every rank with its one line. ``save`` (when the
        checkpoint of ``step`` is due) writes it synchronously first; otherwise ``finish`` waits for a background
        write; the line says how that went."""
        try:
            raise_if_any(self.first)
            return
        except UserError as err:
            failure = str(err)
        try:
            if save is not None:
                save()
                failure += f"; the checkpoint of step {step} was saved"
            else:
                finish()
        except UserError as err:
            failure += f"; the checkpoint was not saved either ({err})"
        raise UserError(failure)
