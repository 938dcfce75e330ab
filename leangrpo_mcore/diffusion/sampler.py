"""The rollout loop: drive a velocity function through T denoising steps and record a :class:`Trajectory`.

The schedule decides, per step, whether the forward runs with gradients (``grad_steps``); the sampler
hands every step to an ``on_step`` callback as a :class:`StepRecord`, whose ``sde`` carries the graph of
that step when gradients were on (Retain keeps it, Reweight backpropagates it at once, Native never asks
for one). With ``per_sample_grad`` (Reweight) a step with gradients runs each trained sample's forward alone
(batch 1) and hands it over before the next one starts, so one sample's graph is alive at a time; the noise
is seeded per sample, so the trajectory is the batched one up to the float rounding of batch 1 against batch
B. The latent is detached between steps, so no gradient flows along the trajectory (docs/algorithms.md §6),
and every stored tensor is float32 (§7): the update evaluates log p at exactly the x_{t+1} drawn here.

Under context parallelism (``split``) every latent of the loop is this rank's piece of the sample
(:mod:`leangrpo_mcore.parallel.sequence`): the initial noise and each step's SDE noise are drawn for the whole
sample and cut, so the trajectory is the one of an unsplit rollout, piece by piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ContextManager, Protocol

import torch

from leangrpo_mcore.diffusion.ode_solvers import RowSolver, make_ode_solver
from leangrpo_mcore.diffusion.sde import SampleMean, SDEStep, check_decreasing, local_mean, sde_step, transition_std
from leangrpo_mcore.diffusion.seeding import step_noise
from leangrpo_mcore.diffusion.trajectory import Conditioning, Trajectory
from leangrpo_mcore.diffusion.velocity import VelocityFn


@dataclass(frozen=True)
class SDEParams:
    """The SDE variant of a run and its schedule constants (docs/algorithms.md §2)."""

    kind: str
    """One of ``SDE_KINDS``."""
    noise_level: float
    """FlowGRPO's a, or DanceGRPO's η."""
    sigma_max: float
    """σ_1 of the schedule (flow_grpo's σ = 1 substitute, Wan's σ_max)."""
    sigma_min: float
    """The schedule's last sigma (Wan's σ_min)."""
    sample_mean: SampleMean = local_mean
    """Mean over a sample's elements for the log-prob and KL (a context-parallel reduction under a split)."""

    @classmethod
    def from_sigmas(cls, kind: str, noise_level: float, sigmas: torch.Tensor) -> SDEParams:
        """Constants read off a (T+1,) schedule or the first row of a (B, T+1) one."""
        row = sigmas if sigmas.ndim == 1 else sigmas[0]
        if row.numel() < 2:
            raise ValueError("a sigma schedule needs at least two entries")
        return cls(kind=kind, noise_level=float(noise_level), sigma_max=float(row[1]), sigma_min=float(row[-1]))

    def step(self, velocity: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             *, prev_sample: torch.Tensor | None = None, generators: list[torch.Generator] | None = None,
             noise: torch.Tensor | None = None) -> SDEStep:
        """One SDE step (draw with ``generators``, add the given ``noise``, or score ``prev_sample``). The sigmas
        are a checked schedule's (:meth:`check_schedule`): nothing here reads tensor data on the host."""
        return sde_step(self.kind, velocity, latents, sigma, sigma_next, noise_level=self.noise_level,
                        prev_sample=prev_sample, generator=generators, sigma_max=self.sigma_max,
                        sigma_min=self.sigma_min, noise=noise, sample_mean=self.sample_mean, check=False)

    def std_t(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        """(B,) std_t of the step (the FlowGRPO KL's denominator, without sqrt(−dt)), of a checked schedule."""
        return transition_std(self.kind, sigma, sigma_next, self.noise_level, self.sigma_max, self.sigma_min,
                              check=False).std_t

    def check_schedule(self, sigmas: torch.Tensor, sde_steps: torch.Tensor) -> None:
        """ValueError unless σ' < σ at every SDE step of the (B, T+1) ``sigmas`` ((B, T) ``sde_steps``): the check
        :func:`~leangrpo_mcore.diffusion.sde.transition_std` would make at every step, made once before a rollout
        (on the host, where the schedule is made), so that no step reads its sigmas back from the device."""
        rows = sde_steps.to(sigmas.device)
        check_decreasing(sigmas[:, :-1][rows], sigmas[:, 1:][rows])


@dataclass
class StepRecord:
    """What the callback sees of denoising step ``t`` of a micro-batch."""

    t: int
    """Step index."""
    latents: torch.Tensor
    """(B, *shape) float32 x_t (detached)."""
    next_latents: torch.Tensor
    """(B, *shape) float32 x_{t+1} (detached)."""
    sigma: torch.Tensor
    """(B,) σ_t."""
    sigma_next: torch.Tensor
    """(B,) σ_{t+1}."""
    sde: SDEStep | None
    """The SDE step (log_prob and mean carry the graph when ``grad`` is True); None for an all-ODE step."""
    train: torch.Tensor
    """(B,) bool: the samples that train this step."""
    grad: bool
    """Whether ``sde`` carries the graph of this record's rows."""
    row: int | None = None
    """The micro-batch row of a per-sample forward (every tensor is then that row's (1, ...) slice); None: the
    whole micro-batch. A per-sample step hands over each trained row, then the step's record with ``grad``
    False (its graphs were handed over already)."""


StepCallback = Callable[[StepRecord], None]


@dataclass
class TrainedRow:
    """One trained sample of a per-sample step whose grad-enabled forward and backward run elsewhere (pipeline
    stages: :func:`~leangrpo_mcore.diffusion.lockstep.rollout_together` with ``train_rows``), with what its loss needs."""

    loop: int
    """Index of its loop in :func:`~leangrpo_mcore.diffusion.lockstep.rollout_together`'s ``loops``."""
    row: int
    """Its row in the loop's micro-batch."""
    latents: torch.Tensor
    """(1, *shape) float32 x_t (detached)."""
    sigma: torch.Tensor
    """(1,) σ_t."""
    conditioning: Conditioning
    """The row's conditioning."""
    record: Callable[[torch.Tensor], StepRecord]
    """The row's step from a velocity that carries the forward's graph: the SDE step with the row's own seeded
    noise, as the :class:`StepRecord` (``grad`` True, ``row`` set) the loop would hand to ``on_step``."""


TrainRows = Callable[[list[TrainedRow]], list[torch.Tensor]]
"""``train_rows(rows) -> [velocity, ...]``: forward and backpropagate every trained row (the schedule's business),
returning each row's detached float32 velocity, the same on every rank that takes the step."""


class LatentPieces(Protocol):
    """This rank's piece of each sample's latent (context parallelism; :class:`parallel.sequence.LatentSplit`)."""

    latent_shape: tuple[int, ...]
    """The whole latent of one sample."""

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """(B, *latent_shape) → (B, n_local)."""

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(B, n_local) → (B, *latent_shape)."""


def _as_batch_sigmas(sigmas: torch.Tensor, batch: int) -> torch.Tensor:
    sigmas = sigmas.to(torch.float32)
    if sigmas.ndim == 1:
        return sigmas.unsqueeze(0).expand(batch, -1).contiguous()
    if sigmas.ndim != 2 or sigmas.shape[0] != batch:
        raise ValueError(f"sigmas must be (T+1,) or ({batch}, T+1), got {tuple(sigmas.shape)}")
    return sigmas


def _grad_mask(grad_steps: torch.Tensor | set[int] | None, selected: torch.Tensor) -> torch.Tensor:
    if grad_steps is None:
        return torch.zeros_like(selected)
    if isinstance(grad_steps, torch.Tensor):
        return grad_steps
    mask = torch.zeros_like(selected)
    for t in grad_steps:
        if not 0 <= int(t) < selected.shape[1]:
            raise ValueError(f"grad step {t} outside [0, {selected.shape[1]})")
        mask[:, int(t)] = True
    return mask


def _check_masks(steps: int, batch: int, **masks: torch.Tensor) -> None:
    for name, mask in masks.items():
        if mask.shape != (batch, steps) or mask.dtype != torch.bool:
            raise ValueError(f"{name} must be a ({batch}, {steps}) bool mask, got {mask.dtype} {tuple(mask.shape)}")


NoiseFn = Callable[[], torch.Tensor]
"""The SDE noise of one forward's rows, in the latents' shape and device (drawn when first asked for)."""


def _denoise_step(velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                  sde_rows: torch.Tensor, sde: SDEParams, noise: NoiseFn, ode: RowSolver) -> SDEStep | None:
    """SDE step for the rows in ``sde_rows`` (host data: a bool per row), ``ode``'s step for the others; None when
    no row uses the SDE."""
    if not bool(sde_rows.any()):
        return None
    out = sde.step(velocity, x, sigma, sigma_next, noise=noise())
    if bool(sde_rows.all()):
        return out
    sde_rows = sde_rows.to(x.device)
    ode = ode.step(velocity.detach(), x, sigma, sigma_next)
    rows = sde_rows.view(-1, *([1] * (x.ndim - 1)))
    zero = torch.zeros_like(out.log_prob)
    return SDEStep(prev_sample=torch.where(rows, out.prev_sample, ode),
                   log_prob=torch.where(sde_rows, out.log_prob, zero), mean=out.mean, std=out.std)


def _advance(velocity: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
             sde_rows: torch.Tensor, sde: SDEParams, noise: NoiseFn, ode: RowSolver
             ) -> tuple[SDEStep | None, torch.Tensor, torch.Tensor]:
    """(SDE step or None, detached x_{t+1}, detached (B,) log-prob) of one forward's rows (``ode`` notes it)."""
    ode.observe(velocity, x, sigma)
    out = _denoise_step(velocity, x, sigma, sigma_next, sde_rows, sde, noise, ode)
    if out is None:
        return None, ode.step(velocity.detach(), x, sigma, sigma_next), torch.zeros(x.shape[0], device=x.device)
    return out, out.prev_sample.detach(), out.log_prob.detach()


def _keep_mean(means: torch.Tensor | None, rows: list[int] | slice, out: SDEStep | None) -> None:
    """Write the rows' SDE mean into ``means`` (kept for the update: docs/algorithms.md §9); nothing when None."""
    if means is not None and out is not None:
        means[rows] = out.mean.detach().to(torch.float32)


def _per_sample_step(velocity_fn: VelocityFn, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                     conditioning: Conditioning, train: torch.Tensor, sde_rows: torch.Tensor, sde: SDEParams,
                     noise: Callable[[list[int]], torch.Tensor], solver: Callable[[list[int]], RowSolver],
                     forward_context: Callable[[bool], ContextManager],
                     hand_over: Callable[[int, SDEStep | None, torch.Tensor], None],
                     means: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step whose trained rows each run a grad-enabled forward of batch 1, handed to ``hand_over(row, sde,
    x_{t+1})`` and freed before the next row's forward; the other rows share one no-grad forward. ``noise(rows)``
    is the step's SDE noise of ``rows``, ``solver(rows)`` their ODE solver; ``means`` receives the SDE means."""
    prev, log_prob = torch.empty_like(x), torch.zeros(x.shape[0], device=x.device)
    trained = train.nonzero().flatten().tolist()
    rest = [r for r in range(x.shape[0]) if r not in trained]
    for rows, grad in ([(rest, False)] if rest else []) + [([r], True) for r in trained]:
        with torch.set_grad_enabled(grad), forward_context(grad):
            velocity = velocity_fn(x[rows], sigma[rows], conditioning.select(rows))
            out, prev[rows], log_prob[rows] = _advance(velocity, x[rows], sigma[rows], sigma_next[rows],
                                                       sde_rows[rows], sde, partial(noise, rows), solver(rows))
        _keep_mean(means, rows, out)
        if grad:
            hand_over(rows[0], out, prev[rows])
        del velocity, out
    return prev, log_prob


class RolloutLoop:
    """The denoising loop of one micro-batch, one step at a time (:func:`rollout` drives one to the end;
    :func:`~leangrpo_mcore.diffusion.lockstep.rollout_together` several in lock-step, each step's forwards handed over at once). Arguments are those
    of :func:`rollout`."""

    def __init__(self, init_latents: torch.Tensor, sigmas: torch.Tensor, conditioning: Conditioning, *,
                 sde: SDEParams, selected: torch.Tensor, sde_steps: torch.Tensor, noise_seeds: torch.Tensor,
                 prompt_ids: torch.Tensor, generation_ids: torch.Tensor,
                 grad_steps: torch.Tensor | set[int] | None = None, on_step: StepCallback | None = None,
                 forward_context: Callable[[bool], ContextManager] | None = None, split: LatentPieces | None = None,
                 per_sample_grad: bool = False, ode_solver: str = "euler", ode_before_window: str = "same",
                 keep_means: bool = False) -> None:
        batch, steps = init_latents.shape[0], noise_seeds.shape[1]
        self.grad_steps = _grad_mask(grad_steps, selected)
        self.forward_context = forward_context or (lambda grad: contextlib.nullcontext())
        _check_masks(steps, batch, selected=selected, sde_steps=sde_steps, grad_steps=self.grad_steps)
        if bool((selected & ~sde_steps).any()):
            raise ValueError("every selected step must be an SDE step (an ODE step has no log-density)")
        host_sigmas = _as_batch_sigmas(sigmas, batch)
        if host_sigmas.shape[1] != steps + 1:
            raise ValueError(f"sigmas have {host_sigmas.shape[1]} entries for {steps} steps (need T+1)")
        sde.check_schedule(host_sigmas, sde_steps)  # once here, so that no step reads its sigmas back
        self.sigmas = host_sigmas.to(init_latents.device)
        self._grads = self.grad_steps.any(dim=0).tolist()
        self._noises: dict[int, torch.Tensor] = {}
        x = init_latents.detach().to(torch.float32)
        self.x = split.shard(x).contiguous() if split is not None else x
        self.conditioning, self.sde, self.selected, self.sde_steps = conditioning, sde, selected, sde_steps
        self.noise_seeds, self.prompt_ids, self.generation_ids = noise_seeds, prompt_ids, generation_ids
        self.on_step, self.split, self.per_sample_grad = on_step, split, per_sample_grad
        self.steps, self.t = steps, 0
        self.ode = make_ode_solver(ode_solver, batch)
        if ode_before_window not in ("same", "euler"):
            raise ValueError(f"ode_before_window must be same or euler, got {ode_before_window!r}")
        self.euler_before_window = ode_before_window == "euler"
        self.keep_means = keep_means
        self._means: list[torch.Tensor] = []
        self._xs: list[torch.Tensor] = []
        self._next_xs: list[torch.Tensor] = []
        self._log_probs: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        """Whether every step has been taken."""
        return self.t >= self.steps

    @property
    def grad(self) -> bool:
        """Whether the next step's forward runs with gradients."""
        return self._grads[self.t]

    def _noise(self, rows: list[int]) -> torch.Tensor:
        """(len(rows), *x.shape[1:]) float32 SDE noise of the current step's ``rows`` on the latents' device. Each
        row's is drawn once per step from its own seed (:func:`~leangrpo_mcore.diffusion.seeding.step_noise`),
        however often its SDE step is formed (the rollout's, a trained row's loss and KL part); under CP the whole
        sample is drawn (a CPU generator cannot start at a piece bitwise) and only this rank's piece is copied."""
        missing = [r for r in rows if r not in self._noises]
        if missing:
            shape = self.split.latent_shape if self.split is not None else tuple(self.x.shape[1:])
            whole = step_noise(self.noise_seeds, self.t, missing, shape)
            piece = (self.split.shard(whole) if self.split is not None else whole).to(self.x.device)
            self._noises.update((r, piece[i:i + 1]) for i, r in enumerate(missing))
        if len(rows) == 1:
            return self._noises[rows[0]]
        return torch.cat([self._noises[r] for r in rows])

    def _solver(self, rows: list[int] | None = None) -> RowSolver:
        """The ODE solver of the current step's ``rows`` (None: all): with ``ode_before_window`` euler, a row
        whose SDE window has not begun yet takes Euler (MixGRPO-Flash's "post" strategy)."""
        first_order = None
        if self.euler_before_window:
            before = ~self.sde_steps[:, : self.t].any(dim=1)
            first_order = before if rows is None else before[rows]
        return self.ode.on(rows, first_order)

    def _mean_buffer(self) -> torch.Tensor | None:
        """A zero (B, *shape) float32 buffer for the current step's SDE means when they are kept, else None."""
        return torch.zeros_like(self.x, dtype=torch.float32) if self.keep_means else None

    def request(self) -> tuple[torch.Tensor, torch.Tensor, Conditioning]:
        """(x_t, σ_t, conditioning): what the next step's forward takes."""
        return self.x, self.sigmas[:, self.t], self.conditioning

    def step(self, velocity_fn: VelocityFn) -> None:
        """Take the next step, calling ``velocity_fn`` for its forward(s)."""
        t, x = self.t, self.x
        sigma, sigma_next = self.sigmas[:, t], self.sigmas[:, t + 1]
        grad, train = self.grad, self.selected[:, t] & self.grad_steps[:, t]
        if grad and self.per_sample_grad:
            def hand_over(row: int, row_sde: SDEStep | None, row_prev: torch.Tensor) -> None:
                if self.on_step is not None:
                    self.on_step(StepRecord(t=t, latents=x[[row]], next_latents=row_prev, sigma=sigma[[row]],
                                            sigma_next=sigma_next[[row]], sde=row_sde, train=train[[row]], grad=True,
                                            row=row))

            means = self._mean_buffer()
            prev, log_prob = _per_sample_step(velocity_fn, x, sigma, sigma_next, self.conditioning, train,
                                              self.sde_steps[:, t], self.sde, self._noise, self._solver,
                                              self.forward_context, hand_over, means)
            self._record(None, prev, log_prob, train, False, means)  # each row's graph was handed over before
            return
        with torch.set_grad_enabled(grad), self.forward_context(grad):
            velocity = velocity_fn(x, sigma, self.conditioning)
            out, prev, log_prob = _advance(velocity, x, sigma, sigma_next, self.sde_steps[:, t], self.sde,
                                           partial(self._noise, list(range(x.shape[0]))), self._solver())
        del velocity
        self._record(out, prev, log_prob, train, grad)

    def trained_rows(self, loop: int) -> list[TrainedRow]:
        """The next step's trained rows (a per-sample step with gradients), for ``train_rows`` (``loop``: this
        loop's index among the ones stepped together)."""
        t, x = self.t, self.x
        sigma, sigma_next = self.sigmas[:, t], self.sigmas[:, t + 1]
        train = self.selected[:, t] & self.grad_steps[:, t]

        def record(row: int, velocity: torch.Tensor) -> StepRecord:
            out = _denoise_step(velocity, x[[row]], sigma[[row]], sigma_next[[row]], self.sde_steps[[row], t],
                                self.sde, partial(self._noise, [row]), self._solver([row]))
            return StepRecord(t=t, latents=x[[row]], next_latents=out.prev_sample.detach(), sigma=sigma[[row]],
                              sigma_next=sigma_next[[row]], sde=out, train=train[[row]], grad=True, row=row)

        return [TrainedRow(loop=loop, row=row, latents=x[[row]], sigma=sigma[[row]],
                           conditioning=self.conditioning.select([row]), record=partial(record, row))
                for row in train.nonzero().flatten().tolist()]

    def untrained_request(self) -> tuple[torch.Tensor, torch.Tensor, Conditioning] | None:
        """(x_t, σ_t, conditioning) of the next step's rows that do not train (None when every row trains)."""
        rest = (~(self.selected[:, self.t] & self.grad_steps[:, self.t])).nonzero().flatten().tolist()
        if not rest:
            return None
        return self.x[rest], self.sigmas[rest, self.t], self.conditioning.select(rest)

    def step_per_sample_with(self, rest_velocity: torch.Tensor | None, row_velocities: dict[int, torch.Tensor]
                             ) -> None:
        """Take a per-sample step whose forwards ran elsewhere: ``rest_velocity`` of :meth:`untrained_request`'s
        rows, the detached velocity of each trained row (already backpropagated: the step's record goes to
        ``on_step`` with ``grad`` False). Each row's SDE step is the one :meth:`step` takes."""
        t, x = self.t, self.x
        sigma, sigma_next = self.sigmas[:, t], self.sigmas[:, t + 1]
        train = self.selected[:, t] & self.grad_steps[:, t]
        trained = train.nonzero().flatten().tolist()
        rest = [r for r in range(x.shape[0]) if r not in trained]
        if sorted(row_velocities) != trained or (rest_velocity is None) != (not rest):
            raise ValueError(f"step {t} needs the velocities of rows {trained} and of the {len(rest)} others")
        prev, log_prob = torch.empty_like(x), torch.zeros(x.shape[0], device=x.device)
        means = self._mean_buffer()
        with torch.no_grad():
            for rows, velocity in ([(rest, rest_velocity)] if rest else []) + \
                    [([r], row_velocities[r]) for r in trained]:
                out, prev[rows], log_prob[rows] = _advance(velocity, x[rows], sigma[rows], sigma_next[rows],
                                                           self.sde_steps[rows, t], self.sde,
                                                           partial(self._noise, rows), self._solver(rows))
                _keep_mean(means, rows, out)
        self._record(None, prev, log_prob, train, False, means)

    def step_with(self, velocity: torch.Tensor) -> None:
        """Take the next step with its ``velocity`` computed elsewhere (:func:`~leangrpo_mcore.diffusion.lockstep.rollout_together`); a step with
        gradients needs a velocity that carries its graph, and a whole-batch forward (not ``per_sample_grad``)."""
        grad = self.grad
        if grad and self.per_sample_grad:
            raise RuntimeError(f"step {self.t} runs each trained row's forward alone: it must be the loop's own")
        t, every = self.t, list(range(self.x.shape[0]))
        with torch.set_grad_enabled(grad):
            out, prev, log_prob = _advance(velocity, self.x, self.sigmas[:, t], self.sigmas[:, t + 1],
                                           self.sde_steps[:, t], self.sde, partial(self._noise, every),
                                           self._solver())
        del velocity
        self._record(out, prev, log_prob, self.selected[:, t] & self.grad_steps[:, t], grad)

    def _record(self, out: SDEStep | None, prev: torch.Tensor, log_prob: torch.Tensor, train: torch.Tensor,
                grad: bool, means: torch.Tensor | None = None) -> None:
        t, x = self.t, self.x
        if self.keep_means:
            if means is None:
                means = self._mean_buffer()
                _keep_mean(means, slice(None), out)
            self._means.append(means)
        self._xs.append(x)
        self._next_xs.append(prev)
        self._log_probs.append(log_prob.to(torch.float32))
        self.ode.commit()
        if self.on_step is not None:
            self.on_step(StepRecord(t=t, latents=x, next_latents=prev, sigma=self.sigmas[:, t],
                                    sigma_next=self.sigmas[:, t + 1], sde=out, train=train, grad=grad))
        self.x, self.t = prev, t + 1
        self._noises = {}

    def trajectory(self) -> Trajectory:
        """The float32 :class:`Trajectory` (detached), once :attr:`done`."""
        if not self.done:
            raise RuntimeError(f"the rollout is at step {self.t} of {self.steps}")
        return Trajectory(
            latents=torch.stack(self._xs, dim=1), next_latents=torch.stack(self._next_xs, dim=1),
            log_probs=torch.stack(self._log_probs, dim=1), sigmas=self.sigmas, selected=self.selected.clone(),
            prompt_ids=self.prompt_ids.to(torch.long), generation_ids=self.generation_ids.to(torch.long),
            conditioning=self.conditioning, final_latents=self.x,
            means=torch.stack(self._means, dim=1) if self.keep_means else None,
        )


def rollout(
    velocity_fn: VelocityFn,
    init_latents: torch.Tensor,
    sigmas: torch.Tensor,
    conditioning: Conditioning,
    *,
    sde: SDEParams,
    selected: torch.Tensor,
    sde_steps: torch.Tensor,
    noise_seeds: torch.Tensor,
    prompt_ids: torch.Tensor,
    generation_ids: torch.Tensor,
    grad_steps: torch.Tensor | set[int] | None = None,
    on_step: StepCallback | None = None,
    forward_context: Callable[[bool], ContextManager] | None = None,
    split: LatentPieces | None = None,
    per_sample_grad: bool = False,
    ode_solver: str = "euler",
    ode_before_window: str = "same",
    keep_means: bool = False,
) -> Trajectory:
    """Sample B trajectories from ``init_latents`` (B, *shape) along ``sigmas`` ((T+1,) or (B, T+1)).

    ``selected`` (B, T) marks the trained steps, ``sde_steps`` (B, T) the steps taken with the SDE (the
    others are ODE steps with log-prob 0), ``noise_seeds`` (B, T) the seed of each step's SDE noise
    (:func:`leangrpo_mcore.diffusion.seeding.sde_noise_seeds`). A step's forward runs with gradients when
    any sample of the batch has it in ``grad_steps`` — a (B, T) bool mask or a set of step indices
    for every sample (default: none, a pure no-grad rollout); the
    callback then receives the step's graph. ``forward_context(grad)`` is entered around each forward
    (e.g. FP8 scaling state; see :mod:`leangrpo_mcore.parallel.precision`). With ``split`` the latents of the
    trajectory are this rank's pieces (module doc). ``per_sample_grad`` runs the trained rows of a step with
    gradients one at a time (:attr:`StepRecord.row`). The ODE steps (``sde_steps`` False) take ``ode_solver``'s
    update (:mod:`leangrpo_mcore.diffusion.ode_solvers`), or Euler's before a row's SDE window with
    ``ode_before_window="euler"`` (MixGRPO-Flash). ``keep_means`` stores every step's SDE mean in the trajectory
    (GRPO-Guard's RatioNorm). Returns the float32 :class:`Trajectory` (detached).
    """
    loop = RolloutLoop(init_latents, sigmas, conditioning, sde=sde, selected=selected, sde_steps=sde_steps,
                       noise_seeds=noise_seeds, prompt_ids=prompt_ids, generation_ids=generation_ids,
                       grad_steps=grad_steps, on_step=on_step, forward_context=forward_context, split=split,
                       per_sample_grad=per_sample_grad, ode_solver=ode_solver, ode_before_window=ode_before_window,
                       keep_means=keep_means)
    while not loop.done:
        loop.step(velocity_fn)
    return loop.trajectory()
