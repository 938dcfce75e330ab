"""Several rollout loops run in lock-step, so that a step's forwards of all of them go through one call (pipeline
stages run their micro-batches' no-grad forwards together: :mod:`leangrpo_mcore.parallel.stages`). Every loop
takes exactly the steps it takes alone (:class:`~leangrpo_mcore.diffusion.sampler.RolloutLoop`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from leangrpo_mcore.diffusion.sampler import RolloutLoop, TrainRows
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import VelocityFn

ManyVelocities = Callable[[list[tuple[torch.Tensor, torch.Tensor, Conditioning]]], list[torch.Tensor]]
"""``velocities([(latents, sigma, conditioning), ...]) -> [velocity, ...]``: several no-grad forwards at once
(pipeline stages: :meth:`leangrpo_mcore.parallel.stages.StagedVelocity.velocities`)."""


def rollout_together(loops: list[RolloutLoop], velocity_fn: VelocityFn, velocities: ManyVelocities, *,
                     with_grad: bool = False, train_rows: TrainRows | None = None) -> None:
    """Run ``loops`` to the end in lock-step: a step in which no loop needs gradients hands all their forwards to
    ``velocities`` at once (entered in each loop's no-grad forward context), and so does, with ``with_grad``, a
    step in which every loop needs them with whole-batch forwards (``velocities`` then runs under grad and
    returns velocities that carry their graphs). With ``train_rows`` (per-sample loops: Reweight) a step in which
    some loop trains hands every untrained forward to ``velocities`` and every trained row, of all the loops, to
    ``train_rows`` at once. Any other step runs each loop's own forwards through ``velocity_fn``. Every loop
    takes exactly the steps it takes alone."""
    while not all(loop.done for loop in loops):
        active = [loop for loop in loops if not loop.done]
        grads = {loop.grad for loop in active}
        if train_rows is not None and True in grads:
            _per_sample_together(loops, active, velocities, train_rows)
            continue
        grad = grads == {True}
        together = grads == {False} or (grad and with_grad and not any(loop.per_sample_grad for loop in active))
        if not together:
            for loop in active:
                loop.step(velocity_fn)
            continue
        with torch.set_grad_enabled(grad), active[0].forward_context(grad):
            out = velocities([loop.request() for loop in active])
        for loop, velocity in zip(active, out):
            loop.step_with(velocity)
        del out


def _per_sample_together(loops: list[RolloutLoop], active: list[RolloutLoop], velocities: ManyVelocities,
                         train_rows: TrainRows) -> None:
    """One step of ``active`` per-sample loops: the untrained forwards through ``velocities`` (no grad), the
    trained rows through ``train_rows``, then each loop's SDE steps."""
    if not all(loop.per_sample_grad for loop in active if loop.grad):
        raise RuntimeError("train_rows steps per-sample loops only")
    requests = [(loop, loop.untrained_request() if loop.grad else loop.request()) for loop in active]
    requests = [(loop, request) for loop, request in requests if request is not None]
    rows = [row for loop in active if loop.grad for row in loop.trained_rows(loops.index(loop))]
    with torch.no_grad(), active[0].forward_context(False):
        rest = dict(zip((id(loop) for loop, _ in requests), velocities([r for _, r in requests]))) \
            if requests else {}
    trained = train_rows(rows)
    for loop in active:
        if not loop.grad:
            loop.step_with(rest[id(loop)])
            continue
        index = loops.index(loop)
        mine = {row.row: velocity for row, velocity in zip(rows, trained) if row.loop == index}
        loop.step_per_sample_with(rest.get(id(loop)), mine)
