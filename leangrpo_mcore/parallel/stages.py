"""Pipeline parallelism (``parallel.pp``): one policy forward handed from stage to stage, lock-step.

The pp ranks of a sample (one per stage, megatron-core's pipeline-parallel group) run the same step program:
the same groups, draws, rollouts, rewards and schedule hooks, in the same order. Only the policy forward is
split. Stage s runs its blocks (``models.common.pipeline``) on the boundary tensor received from stage s−1 and
sends its own boundary to stage s+1; the last stage turns its output into the float32 velocity and broadcasts
it to the other stages, so every stage continues with the same velocity bit for bit, takes the same SDE step
and holds the same trajectory. The hand-offs are autograd functions, so that a backward on every stage (each
one backpropagates the same loss: the schedules do not change) runs the pipeline's backward:

- the last stage's graph starts at the received boundary; its backward sends the boundary's gradient to the
  stage before (:class:`_SendsGradBack`);
- an earlier stage's velocity is the output of :class:`_Handed`, whose forward sends the boundary and receives
  the velocity, and whose backward ignores the velocity's gradient (the last stage owns it) and continues with
  the boundary gradient received from the next stage.

Point-to-point transfers go through megatron-core's ``P2PCommunicator`` (``send_forward`` / ``recv_forward`` /
``send_backward`` / ``recv_backward``, shapes exchanged first); the velocity broadcast is one collective of the
pipeline group, one per pipelined call whatever its number of requests. A lock-step forward does not pipeline
across samples: while one stage computes, the others wait in a receive, and that wait is the ``bubble`` phase of
the step's breakdown ((pp − 1)/pp of its time per stage). The step's bulk therefore goes through megatron's
pipelined schedules instead, several forwards at once: :meth:`StagedVelocity.velocities` (forward-only, graphs
kept under grad) and :meth:`StagedVelocity.trained` (1F1B, each forward backpropagated at once); a lock-step
forward is only ever a single one (a pipelined call of one request). What each stage holds is its own: its
blocks' parameters, gradients, optimizer state, graphs (Retain) and provisional gradients (Reweight), all
synchronised over the stage's own data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import SplitVelocity
from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.parallel.pipeline import ScheduleConfig, cpu_bridge, loss_triple

PhaseFn = Callable[[str], ContextManager]

BUBBLE = "bubble"
"""Phase name of the time a stage waits for another stage's forward or backward."""


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


class StageLink:
    """This rank's place in its pipeline and the transfers of one forward / backward (see module doc)."""

    def __init__(self, ctx: ParallelContext, dtype: torch.dtype) -> None:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if ctx.pp_group is None:
            raise ValueError("a stage link needs a pipeline-parallel group (parallel.pp > 1)")
        self.rank, self.size, self.group = ctx.pp_rank, int(ctx.layout.pp), ctx.pp_group
        self.ctx = ctx
        self.dtype = dtype
        """dtype of the boundary tensors (the policy's compute dtype)."""
        self.last_rank = dist.get_global_rank(self.group, self.size - 1)
        config = ScheduleConfig(pipeline_dtype=dtype, variable_seq_lengths=True, batch_p2p_comm=True,
                                batch_p2p_sync=False)
        self.comm = P2PCommunicator(pp_group=self.group, config=config)
        self.phase: PhaseFn = _no_phase
        """The step's phase hook (set by the step engine per step): waits are timed as :data:`BUBBLE`."""
        self.waited = 0.0
        """Seconds spent in :data:`BUBBLE` so far (a forward's timer subtracts what it waited inside)."""

    def track(self, name: str) -> ContextManager:
        """The step's phase ``name``; a :data:`BUBBLE` one also counts into :attr:`waited` (the phase hook of
        megatron's schedules run inside a forward)."""
        return self._waiting() if name == BUBBLE else self.phase(name)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self.phase(BUBBLE):
                yield
        finally:
            self.waited += time.perf_counter() - start

    @property
    def first(self) -> bool:
        """Whether this rank is the first stage (it owns the embedders)."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Whether this rank is the last stage (it owns the output layers and produces the velocity)."""
        return self.rank == self.size - 1

    # ------------------------------------------------------------------ transfers
    def recv_forward(self) -> torch.Tensor:
        """The previous stage's boundary tensor."""
        with self._waiting(), cpu_bridge():
            return self.comm.recv_forward((0, 0, 0), is_first_stage=False).detach()

    def send_forward(self, boundary: torch.Tensor) -> None:
        """Send this stage's boundary tensor to the next stage."""
        with cpu_bridge():
            self.comm.send_forward(boundary.detach().contiguous(), is_last_stage=False)

    def recv_backward(self) -> torch.Tensor:
        """The next stage's gradient of this stage's boundary tensor."""
        with self._waiting(), cpu_bridge():
            return self.comm.recv_backward((0, 0, 0), is_last_stage=False)

    def send_backward(self, grad: torch.Tensor) -> None:
        """Send the gradient of the received boundary tensor to the previous stage."""
        with cpu_bridge():
            self.comm.send_backward(grad.contiguous(), is_first_stage=False)

    def broadcast_velocity(self, velocity: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The last stage's float32 velocity on every stage (``like``: the latents, whose shape it has)."""
        return self.broadcast_velocities([velocity], [like])[0]

    def broadcast_velocities(self, velocities: list[Optional[torch.Tensor]], likes: list[torch.Tensor]
                             ) -> list[torch.Tensor]:
        """The last stage's float32 velocities on every stage (``likes``: the latents, whose shapes they have),
        all in one collective: a pipelined call ends with one broadcast, not one blocking broadcast per request."""
        if not likes:
            return []
        if self.last:
            parts = [v.detach().to(torch.float32).reshape(-1) for v in velocities]
            flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        else:
            flat = torch.empty(sum(like.numel() for like in likes), dtype=torch.float32, device=likes[0].device)
        with self._waiting() if not self.last else contextlib.nullcontext():
            dist.broadcast(flat, src=self.last_rank, group=self.group)
        if self.last:
            return [v.detach().contiguous() for v in velocities]
        pieces = flat.split([like.numel() for like in likes])
        return [piece.view(like.shape) for piece, like in zip(pieces, likes)]

    # ------------------------------------------------------------------ autograd hand-offs
    def received(self) -> torch.Tensor:
        """The boundary tensor from the previous stage; under grad its backward sends the gradient back."""
        boundary = self.recv_forward().requires_grad_(torch.is_grad_enabled())
        return _SendsGradBack.apply(boundary, self)

    def handed(self, boundary: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Send ``boundary`` on and return the velocity from the last stage; under grad its backward receives
        the boundary's gradient from the next stage."""
        return _Handed.apply(boundary, like, self)


class _Handed(torch.autograd.Function):
    """Forward: send the boundary, receive the velocity. Backward: the boundary gradient from the next stage."""

    @staticmethod
    def forward(ctx, boundary: torch.Tensor, like: torch.Tensor, link: StageLink) -> torch.Tensor:
        ctx.link = link
        link.send_forward(boundary)
        return link.broadcast_velocity(None, like)

    @staticmethod
    def backward(ctx, grad_velocity: torch.Tensor):
        return ctx.link.recv_backward(), None, None


class _SendsGradBack(torch.autograd.Function):
    """A boundary received from the previous stage (a leaf: received in a lock-step forward, or handed over by
    megatron's scheduler); backward sends its gradient back to that stage."""

    @staticmethod
    def forward(ctx, boundary: torch.Tensor, link: StageLink) -> torch.Tensor:
        ctx.link = link
        return boundary.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.link.send_backward(grad)
        return None, None


class _Tied(torch.autograd.Function):
    """The last stage's broadcast velocity as a function of this stage's boundary tensor: backward ignores the
    velocity's gradient (the last stage owns it) and continues with the boundary gradient from the next stage,
    as :class:`_Handed` does for a lock-step forward."""

    @staticmethod
    def forward(ctx, boundary: torch.Tensor, link: StageLink, velocity: list) -> torch.Tensor:
        ctx.link = link
        return velocity[0]

    @staticmethod
    def backward(ctx, grad_velocity: torch.Tensor):
        return ctx.link.recv_backward(), None, None


class StagedVelocity:
    """A velocity function whose policy is one pipeline stage (``parallel.pp`` > 1): the same signature and
    the same float32 velocity on every stage (module doc).

    ``inner`` is the family's velocity function (:mod:`leangrpo_mcore.diffusion.velocity`) around this rank's
    stage; its :meth:`policy_inputs` / :meth:`velocity_from_output` split the call around the policy forward.
    """

    def __init__(self, inner, link: StageLink) -> None:
        self.inner, self.link = inner, link
        self.policy = inner.policy
        self._scheduled = False

    @contextlib.contextmanager
    def scheduled(self) -> Iterator[None]:
        """Calls inside are the forwards of megatron's pipelined schedule, which moves the boundaries itself: a
        stage takes its input from ``set_input_tensor`` (set by the schedule), the last stage returns the velocity
        without broadcasting it, and the others use :meth:`boundary` instead."""
        self._scheduled = True
        try:
            yield
        finally:
            self._scheduled = False

    def boundary(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """This stage's boundary tensor (inside :meth:`scheduled`, on a stage other than the last)."""
        return self.policy(**self.inner.policy_inputs(latents, sigma, conditioning))

    def boundary_shape(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]
                       ) -> Optional[tuple[int, ...]]:
        """The boundary shape every forward of ``requests`` sends and receives (a pipelined call's
        ``tensor_shape``), from the policy stage's ``boundary_shape`` and the requests' shapes alone; None when the
        policy cannot tell it or the requests differ in it (then the shapes travel with every transfer)."""
        shape_of = getattr(self.policy, "boundary_shape", None)
        if shape_of is None:
            return None
        shapes = {tuple(shape_of(**self.inner.policy_inputs(*_on_meta(request))))
                  for request in _distinct(requests).values()}
        return shapes.pop() if len(shapes) == 1 else None

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """(B, *shape) float32 velocity, identical on every stage."""
        inputs = self.inner.policy_inputs(latents, sigma, conditioning)
        if self._scheduled:
            if not self.link.last:
                raise RuntimeError("inside megatron's pipelined schedule a stage other than the last returns its "
                                   "boundary (StagedVelocity.boundary), not a velocity")
            return self.inner.velocity_from_output(self.policy(**inputs))
        if not self.link.first:
            self.policy.set_input_tensor(self.link.received())
        out = self.policy(**inputs)
        if self.link.last:
            velocity = self.inner.velocity_from_output(out)
            self.link.broadcast_velocity(velocity, latents)
            return velocity
        return self.link.handed(out, latents)

    def velocities(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]) -> list[torch.Tensor]:
        """The velocities of several forwards (one per rollout micro-batch), pipelined: megatron's forward-only
        schedule over the stages, so that stage s computes micro-batch i while stage s+1 computes micro-batch
        i−1; then the last stage broadcasts every velocity. Equal to calling this function once per request, bit
        for bit.

        Under grad (Retain's trained steps) every velocity keeps its graph on every stage, as a lock-step forward's
        does: the last stage's is the policy's output, whose received boundary sends its gradient back
        (:class:`_SendsGradBack`); an earlier stage's is tied to its boundary tensor (:class:`_Tied`). A later
        backward of each stage's graphs, in the same order on every stage, is then a backward pipeline: while
        stage s backpropagates graph i, stage s+1 backpropagates graph i+1 (GPipe's backward half)."""
        if len(requests) == 1:
            return [self(*requests[0])]
        from leangrpo_mcore.parallel.pipeline import run_micro_batches

        keep = torch.is_grad_enabled()
        boundaries = []

        def forward_step(data_iterator, model):
            latents, sigma, conditioning = next(data_iterator)
            if not self.link.last:
                boundary = self.boundary(latents, sigma, conditioning)
                if keep:  # only a kept graph needs its boundary (_Tied below); else the send is its last use
                    boundaries.append(boundary)
                return boundary, None
            return self(latents, sigma, conditioning), None  # no loss: the scheduler keeps the velocity

        hook = (lambda boundary: _SendsGradBack.apply(boundary, self.link)) if keep and not self.link.first \
            else None
        with self.scheduled():
            out = run_micro_batches(forward_step, requests, None, phase=self.link.track, phases={},
                                    forward_only=True, dtype=self.link.dtype, pipeline=self.policy,
                                    ctx=self.link.ctx, input_hook=hook, tensor_shape=self.boundary_shape(requests))
        shared = self.link.broadcast_velocities(list(out) if self.link.last else [None] * len(requests),
                                                [latents for latents, _, _ in requests])
        if not keep:
            return shared
        if self.link.last:
            return list(out)
        return [_Tied.apply(boundary, self.link, [velocity]) for boundary, velocity in zip(boundaries, shared)]

    def trained(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]], units: list[int],
                loss_of: Callable[[int, torch.Tensor], torch.Tensor],
                route: Callable[[int, torch.Tensor], torch.Tensor], grad_sync, *, phases: dict[str, str],
                forward_context: Callable[[bool], ContextManager]) -> list[torch.Tensor]:
        """Grad-enabled forwards, each backpropagated at once, as megatron's 1F1B schedule over the stages: stage s
        runs micro-batch k's backward while stage s+1 runs micro-batch k+1's forward. Micro-batch k is a forward of
        ``requests[units[k]]`` (a request may be trained more than once, each time with a forward of its own);
        returns each request's float32 velocity, detached, on every stage.

        On the last stage ``loss_of(k, velocity)`` forms micro-batch k's loss from its velocity (the scheduler
        backpropagates it); ``route(k, output)`` hooks micro-batch k's output on every stage (the boundary, or the
        last stage's velocity) so that its backward's gradient lands in k's own slot
        (:meth:`~leangrpo_mcore.parallel.routing.GradientRouter.route`); ``grad_sync`` holds the reductions off or
        not (its mode), ``phases`` maps megatron's compute timers to the step's phases (its transfers and waits are
        the :data:`BUBBLE`), and ``forward_context(True)`` is entered around each forward."""
        from leangrpo_mcore.parallel.pipeline import run_micro_batches

        outputs: dict[int, torch.Tensor] = {}

        def forward_step(data_iterator, model):
            k, index = next(data_iterator)
            with torch.enable_grad(), forward_context(True):
                if not self.link.last:
                    return route(k, self.boundary(*requests[index])), None
                velocity = route(k, self(*requests[index]))
            outputs[index] = velocity.detach()
            return velocity, lambda output: loss_triple(loss_of(k, output))

        with self.scheduled():
            run_micro_batches(forward_step, list(enumerate(units)), grad_sync, phase=self.link.track,
                              phases=phases, dtype=self.link.dtype, pipeline=self.policy,
                              tensor_shape=self.boundary_shape([requests[i] for i in sorted(set(units))]))
        return self.link.broadcast_velocities([outputs.get(i) for i in range(len(requests))],
                                              [latents for latents, _, _ in requests])

    def reference(self) -> contextlib.AbstractContextManager:
        """The inner function's reference context (adapters disabled on every stage)."""
        return self.inner.reference()


class SplitStages(SplitVelocity):
    """Pipeline stages on this rank's pieces of the latents (``parallel.pp`` > 1 with ``parallel.cp`` > 1): every
    call of :class:`StagedVelocity` with the pieces gathered into whole latents first and this rank's piece of
    each velocity kept after, as :class:`~leangrpo_mcore.diffusion.velocity.SplitVelocity` does for one forward.
    Inside, each CP rank of a stage holds its tokens of the boundary tensors (the policy's sequence-parallel
    forward) and exchanges them with the same CP rank of the next stage."""

    @property
    def link(self) -> StageLink:
        """The inner stages' link."""
        return self.inner.link

    @property
    def policy(self) -> torch.nn.Module:
        """This rank's policy stage."""
        return self.inner.policy

    def scheduled(self) -> contextlib.AbstractContextManager:
        """The inner stages' scheduled mode (:meth:`StagedVelocity.scheduled`)."""
        return self.inner.scheduled()

    def boundary_shape(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]
                       ) -> Optional[tuple[int, ...]]:
        """:meth:`StagedVelocity.boundary_shape` of the pieces (the whole latents' shape, without gathering)."""
        whole = [(torch.empty((latents.shape[0], *self.split.latent_shape), dtype=latents.dtype, device="meta"),
                  sigma, conditioning) for latents, sigma, conditioning in requests]
        return self.inner.boundary_shape(whole)

    def _whole(self, requests: list) -> list:
        return [(self.split.gather(latents), sigma, conditioning) for latents, sigma, conditioning in requests]

    def boundary(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """This stage's boundary tensor (:meth:`StagedVelocity.boundary`) of the pieces ``latents``."""
        return self.inner.boundary(self.split.gather(latents), sigma, conditioning)

    def velocities(self, requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]) -> list[torch.Tensor]:
        """:meth:`StagedVelocity.velocities` of the pieces; each velocity this rank's piece."""
        return [self.split.shard(v) for v in self.inner.velocities(self._whole(requests))]

    def trained(self, requests: list, units: list[int], loss_of: Callable[[int, torch.Tensor], torch.Tensor],
                route: Callable[[int, torch.Tensor], torch.Tensor], grad_sync, *, phases: dict[str, str],
                forward_context: Callable[[bool], ContextManager]) -> list[torch.Tensor]:
        """:meth:`StagedVelocity.trained` of the pieces: ``loss_of`` sees this rank's piece of each velocity."""
        out = self.inner.trained(self._whole(requests), units, lambda k, v: loss_of(k, self.split.shard(v)),
                                 route, grad_sync, phases=phases, forward_context=forward_context)
        return [self.split.shard(v) for v in out]


def _distinct(requests: list[tuple[torch.Tensor, torch.Tensor, Conditioning]]) -> dict:
    """One request per distinct signature (the shapes of its latents, sigma and conditioning tensors)."""
    out = {}
    for request in requests:
        latents, sigma, conditioning = request
        fields = (getattr(conditioning, f.name) for f in dataclasses.fields(conditioning))
        key = (tuple(latents.shape), tuple(sigma.shape),
               tuple(None if t is None else tuple(t.shape) for t in fields))
        out.setdefault(key, request)
    return out


def _on_meta(request: tuple[torch.Tensor, torch.Tensor, Conditioning]) -> tuple:
    """``request`` with every tensor on the meta device: its shapes and dtypes, no data (nothing computed)."""
    def meta(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")

    latents, sigma, conditioning = request
    fields = {f.name: meta(getattr(conditioning, f.name)) for f in dataclasses.fields(conditioning)}
    return meta(latents), meta(sigma), dataclasses.replace(conditioning, **fields)


def split_velocity(inner, split) -> SplitVelocity:
    """``inner`` on this rank's pieces of the latents (context parallelism): :class:`SplitStages` around pipeline
    stages, :class:`~leangrpo_mcore.diffusion.velocity.SplitVelocity` otherwise."""
    return SplitStages(inner, split) if hasattr(inner, "scheduled") else SplitVelocity(inner, split)

