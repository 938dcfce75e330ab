"""LeanGRPO-Reweight (§4.3, Algorithm 1): immediate backward with advantage 1, rescale when the reward arrives.

Each selected step runs with gradients and is backpropagated at once, with advantage 1 and gradient
synchronisation off, into the sample's *provisional gradient* P_i = Σ_t ∇(−w·log p_{i,t}) (kept in the
local unsharded slot and moved out without copying); in micro-batches of B > 1 each trained sample's forward runs
alone, so each backward is of one sample's graph. When the advantages are known each P_i is scaled by
its A_i **before any cross-sample reduction**, the scaled sum is reduced with one coalesced
reduce-scatter per group, and accumulated into the sharded gradients: correction → sync → accumulation.
At ρ ≡ 1 this is the Native gradient (−A·∇log p), exactly up to float rounding.

Options and exactness (never approximate silently):

- ``accumulate="affine"`` (beyond the paper): within a group A_i = α·r_i + γ, so the accumulators
  R = Σ (r_i − c)·P_i and S = Σ P_i (c = the group's first local reward, to avoid cancellation) give
  Σ A_i·P_i = α·R + (α·c + γ)·S; each P_i is folded as soon as its own reward is known, so memory does
  not grow with the generations per rank. Exact whenever the clamp cannot fire: |A| ≤ sqrt(M − 1) (ddof 0)
  or (M − 1)/sqrt(M) (ddof 1) per group. :func:`plan_reweight` falls back to per-sample buffers otherwise.
- KL (β > 0): its gradient does not scale with A_i, so it is backpropagated separately (a second backward
  of the same graph) into an unscaled accumulator that joins the group's reduction (one accumulator per
  group, so that a group rolled out while the one before still waits for its rewards keeps its own; with
  global std one for the whole step, reduced with the first group).
- megatron-core's scheduler: every backward that frees its graph is one micro-batch of
  ``get_forward_backward_func()`` (:mod:`leangrpo_mcore.parallel.pipeline`), the gradient sync held off by its
  ``no_sync_func`` (the coalesced mode: the provisional gradient stays in the local slot) and moved out right after
  the call; the correction and the one reduction per group run after the scheduler, in ``on_advantages``. A
  backward that must keep its graph for a second one (the KL part) is a plain autograd call.
- pipeline stages (``parallel.pp`` > 1): the trained samples of a denoising step of the group's micro-batches go to
  :meth:`ReweightSchedule.train_rows` together, one megatron 1F1B call whose micro-batches are the samples'
  forwards (of one sample each) with their immediate backwards. A
  :class:`~leangrpo_mcore.parallel.routing.GradientRouter` hooks each forward's output with its sample's key, so
  that the backward of that forward, whenever the schedule runs it, finds the sample's provisional gradient
  installed in the local slot and moves it out after, on every stage (each holds its blocks' part). After the
  call every micro-batch must have been routed exactly once, to the same key on every stage, and every sample
  must have a provisional gradient when its advantage arrives: otherwise
  :class:`~leangrpo_mcore.parallel.routing.RoutingError`, never a silent reduction. The KL part cannot be a
  second backward of a 1F1B micro-batch, so with β > 0 a sample is two micro-batches, each with its forward: the
  KL part into the group's accumulator, then the policy-gradient part (one extra forward per trained sample and
  step). Rewards, advantages, correction and reduction are those above, on every stage.
- global std: A_i = (r_i − mean_g)/(std_global + eps). When the clamp provably cannot fire, each group's
  Σ (r_i − mean_g)·P_i is folded as soon as the group's rewards are gathered and the sum is multiplied by
  α = 1/(std_global + eps) once at the end of the update. Otherwise the per-sample buffers are kept until
  the whole step's rewards are known and scaled by the exact clamped advantages.
- several rewards (``reward.aggregate: advantages``): A_i = Σ_k w_k A_{k,i} is no affine function of one reward
  (each component has its own group mean and std), so neither the affine accumulators nor the global-std fold
  apply: :func:`plan_reweight` keeps per-sample buffers, each scaled by its exact A_i.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from leangrpo_mcore.diffusion.sampler import StepRecord, TrainedRow
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.parallel.grad_sync import LocalGrads, grads_add_
from leangrpo_mcore.parallel.pipeline import loss_triple, run_micro_batches
from leangrpo_mcore.parallel.precision import torch_dtype
from leangrpo_mcore.parallel.routing import GradientRouter, RoutingError
from leangrpo_mcore.schedules.base import (
    GroupUpdate,
    Schedule,
    ScheduleContext,
    UnitKey,
    UpdateStats,
    guard_terms,
    kl_unit_loss,
    kl_value,
    pipelined,
    register_schedule,
    unit_loss,
)

ACCUMULATE_MODES = ("per_sample", "affine")
AGGREGATE_MODES = ("rewards", "advantages")
_DDOF = {"flow_grpo": 0, "dance_grpo": 1}


def max_abs_advantage(advantage: str, group_size: int, num_rewards: Optional[int] = None) -> float:
    """Upper bound of |A| before clamping for groups of ``group_size`` (global std over ``num_rewards``)."""
    if advantage not in _DDOF:
        raise ValueError(f"no advantage bound for {advantage!r}; valid: {', '.join(_DDOF)}")
    m = group_size
    if _DDOF[advantage] == 0:
        return math.sqrt((m - 1) * (num_rewards / m if num_rewards else 1.0))
    return math.sqrt((m - 1) * (num_rewards - 1) / m) if num_rewards else (m - 1) / math.sqrt(m)


@dataclass(frozen=True)
class ReweightPlan:
    """How Reweight accumulates for a configuration (decided before the run)."""

    accumulate: str
    """``per_sample`` or ``affine`` (after any fallback)."""
    global_fold: bool
    """Global std folded per group and scaled once at the end (clamp cannot fire)."""
    note: str = ""
    """Why a fallback happened (empty when none)."""
    provisional_dtype: Optional[str] = None
    """dtype the provisional gradients wait in (``float32`` / ``bfloat16``; None: as the backward leaves them).
    They go back to the gradient slot's dtype for every further backward and for the reduction."""
    global_std: bool = False
    """Advantages wait for the whole step: the KL of every group is accumulated together."""


def plan_reweight(accumulate: str, *, advantage: str, group_size: int, prompts_per_step: int,
                  adv_clip_max: Optional[float], global_std: bool, aggregate: str = "rewards") -> ReweightPlan:
    """Pick the exact accumulation for these settings; ``affine`` falls back to per-sample when clamping may fire,
    and both ``affine`` and the global-std fold when ``aggregate`` is ``advantages`` (one advantage per reward)."""
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"unknown reweight accumulation {accumulate!r}; valid: {', '.join(ACCUMULATE_MODES)}")
    if aggregate not in AGGREGATE_MODES:
        raise ValueError(f"unknown reward aggregation {aggregate!r}; valid: {', '.join(AGGREGATE_MODES)}")
    if aggregate == "advantages":
        folds = [what for what, on in (("affine accumulation", accumulate == "affine"),
                                       ("the global-std fold", global_std)) if on]
        note = (f"reward.aggregate=advantages: A = Σ_k w_k A_k is no affine function of one reward, so "
                f"{' and '.join(folds)} cannot apply; each sample keeps its own provisional gradient until its exact "
                f"advantage is known") if folds else ""
        return ReweightPlan(accumulate="per_sample", global_fold=False, note=note, global_std=global_std)
    total = group_size * prompts_per_step if global_std else None
    bound = max_abs_advantage(advantage, group_size, total)
    safe = adv_clip_max is None or bound <= adv_clip_max
    if safe:
        return ReweightPlan(accumulate=accumulate, global_fold=global_std, global_std=global_std)
    note = (f"|A| can reach {bound:.3g} > adv_clip_max {adv_clip_max}: the clamp may fire, so each sample keeps "
            f"its own provisional gradient until its exact advantage is known")
    return ReweightPlan(accumulate="per_sample", global_fold=False, note=note, global_std=global_std)


PHASES = {"backward-compute": "backward"}
"""megatron's timer names → this schedule's phases."""


def _formed(data_iterator: Iterator[torch.Tensor], model) -> tuple[torch.Tensor, Callable]:
    """megatron's ``forward_step_func`` of a loss formed already (its forward was the rollout's)."""
    return next(data_iterator), loss_triple


def _scaled_sum(terms: list[tuple[float, LocalGrads]]) -> LocalGrads:
    """Σ scale·grads, consuming the buffers (the first is scaled in place)."""
    out: Optional[LocalGrads] = None
    for scale, grads in terms:
        if out is None:
            out = [None if g is None else g.mul_(scale) for g in grads]
        else:
            out = grads_add_(out, grads, scale)
    return out or []


@register_schedule("reweight")
class ReweightSchedule(Schedule):
    """Immediate unit-advantage backward into per-sample provisional gradients, rescaled by A_i."""

    recompute_free = True
    # A sample's provisional gradient needs a backward of its own: backpropagating each row of a batched graph
    # would cost B backwards of the whole micro-batch, so each trained sample runs a forward of batch 1
    # (docs/algorithms.md §6, Reweight).
    per_sample_grad = True
    trains_rows = True

    def __init__(self, context: ScheduleContext, *, plan: ReweightPlan = ReweightPlan("per_sample", False)) -> None:
        super().__init__(context)
        self.plan = plan

    def begin_update(self, weight: float) -> None:
        """Start an update with empty accumulators."""
        super().begin_update(weight)
        self._partial: dict[tuple[int, int, int], LocalGrads] = {}
        self._unit_loss: dict[tuple[int, int, int], torch.Tensor] = {}
        self._kl: dict[int, LocalGrads] = {}
        self._kl_losses: dict[int, list[torch.Tensor]] = {}
        self._affine: dict[int, list] = {}
        self._folded: Optional[LocalGrads] = None
        self._alpha: Optional[float] = None
        self._held: Optional[tuple[dict, object]] = None

    # ------------------------------------------------------------------ rollout: immediate backward
    @contextlib.contextmanager
    def _accumulating(self, store: dict, key) -> Iterator[None]:
        """Backwards inside accumulate into ``store[key]`` (an empty slot when it has none yet), which then holds
        the result, moved out of the slot."""
        self._settle()
        sync = self.ctx.grad_sync
        if store.get(key) is not None:
            sync.put_local(self._to_slot(store[key]))
        yield
        store[key] = self._from_slot(sync.take_local())

    def _from_slot(self, grads: LocalGrads) -> LocalGrads:
        """Gradients moved out of the slot, in the provisional dtype (the slot's dtypes remembered)."""
        if self.plan.provisional_dtype is None:
            return grads
        self._slot_dtypes = [None if g is None else g.dtype for g in grads]
        dtype = torch_dtype(self.plan.provisional_dtype)
        return [None if g is None else g.to(dtype) for g in grads]

    def _hold(self, store: dict, key) -> None:
        """Make the local slot accumulate into ``store[key]``, which stays in the slot until another target takes
        its place (or :meth:`_settle`): one pass over the parameters per sample moves the previous target's
        gradient back to its store and this one's in (``GradSync.swap_local``), instead of one pass to install it
        and another to take it out after every backward; the same target twice in a row moves nothing. Only
        without a provisional dtype (which rounds the gradient after every backward: :meth:`_accumulating`)."""
        if self._held is not None and self._held[0] is store and self._held[1] == key:
            return
        out = self.ctx.grad_sync.swap_local(store.pop(key, None))
        if self._held is not None:
            self._held[0][self._held[1]] = out
        self._held = (store, key)

    def _settle(self) -> None:
        """Move the held target's gradient out of the slot into its store: before anything reads the stores or
        another backward uses the slot."""
        if self._held is not None:
            store, key = self._held
            self._held = None
            store[key] = self.ctx.grad_sync.take_local()

    def _backward_into(self, store: dict, key, loss: torch.Tensor, retain_graph: bool) -> None:
        """Backpropagate ``loss`` into ``store[key]`` (:meth:`_hold`). The last backward of a graph is a
        megatron micro-batch; one whose graph is backpropagated again (the KL part, another row of a batched graph)
        keeps it, which megatron's backward cannot, and runs as a plain autograd call."""
        sync = self.ctx.grad_sync
        if self.plan.provisional_dtype is None:
            self._hold(store, key)
            slot = contextlib.nullcontext()
        else:
            slot = self._accumulating(store, key)
        with slot:
            if retain_graph:
                with self.ctx.phase("backward"):
                    sync.backward_local(loss, retain_graph=True)
            else:
                run_micro_batches(_formed, [loss], sync, phase=self.ctx.phase, phases=PHASES)

    def _to_slot(self, grads: LocalGrads) -> LocalGrads:
        """``grads`` in the dtypes the gradient slot holds (undoing the provisional dtype)."""
        dtypes = getattr(self, "_slot_dtypes", None)
        if dtypes is None or self.plan.provisional_dtype is None:
            return grads
        return [g if g is None or d is None else g.to(d) for g, d in zip(grads, dtypes)]

    def held_gradients(self) -> Iterator[torch.Tensor]:
        """The provisional gradients and accumulators held now (the held target's in the slot included)."""
        if self._held is not None:
            yield from self.ctx.grad_sync.local_tensors()
        held = [*self._partial.values(), *self._kl.values(), *(acc[1:] for acc in self._affine.values()),
                self._folded]
        for item in held:
            for tensor in (item or ()):
                if isinstance(tensor, torch.Tensor):
                    yield tensor
                elif isinstance(tensor, (list, tuple)):
                    yield from (t for t in tensor if isinstance(t, torch.Tensor))

    def _track_buffers(self) -> None:
        # the held target (in the slot, out of its store) is one buffer too
        live = len(self._partial) + sum(2 for _ in self._affine) + len(self._kl) + (self._folded is not None) + \
            (self._held is not None)
        self.stats.max_local_grad_buffers = max(self.stats.max_local_grad_buffers, live)

    def on_step(self, key: UnitKey, conditioning: Conditioning) -> Callable[[StepRecord], None]:
        """Backpropagate each trained step of micro-batch ``key`` at once, one provisional gradient per sample
        (a record of one sample, :attr:`StepRecord.row`, or of the whole micro-batch)."""

        def backward_now(record: StepRecord) -> None:
            if not record.grad or not bool(record.train.any()):
                return
            log_prob, train = record.sde.log_prob, record.train
            kl = None
            if self.ctx.objective.kl_beta > 0:
                cond = conditioning if record.row is None else conditioning.select([record.row])
                kl = self.step_kl(record.sde.mean, record.sde.std, record.latents, record.next_latents,
                                  record.sigma, record.sigma_next, cond)
            if kl is not None:
                group = self._kl_group(key[0])
                self._backward_into(self._kl, group, self._kl_part(group, kl, train), True)
            rows = train.nonzero().flatten().tolist()
            for n, row in enumerate(rows):
                only = torch.zeros_like(train)
                only[row] = True
                sample = (*key, row if record.row is None else record.row)
                self._backward_into(self._partial, sample, self._provisional(sample, record, only), n < len(rows) - 1)
            self._track_buffers()

        return backward_now

    def _kl_part(self, group: int, kl: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
        """The KL part of a step's loss, recorded for the group's loss (backpropagated unscaled)."""
        part = kl_unit_loss(kl, train, self.weight, self.ctx.objective)
        self._kl_losses.setdefault(group, []).append(part.detach())
        return part

    def _provisional(self, sample: tuple[int, int, int], record: StepRecord, only: torch.Tensor) -> torch.Tensor:
        """The unit-advantage loss of ``sample`` (its row ``only`` of step ``record``), recorded for the group's loss.
        On this first update ρ = 1: GRPO-Guard's RatioNorm then scales the gradient by the step's s and its
        reweighting by the step's weight, constants of the step that the unit loss carries as Native's does."""
        log_prob = record.sde.log_prob
        guard = guard_terms(self.ctx.sde, self.ctx.objective, record.sde, record.sde.mean.detach(), record.sigma,
                            record.sigma_next)
        loss, ratio = unit_loss(log_prob, log_prob.detach(), torch.ones_like(log_prob.detach()), only, self.weight,
                                self.ctx.objective, guard=guard)
        self._unit_loss[sample] = self._unit_loss.get(sample, 0.0) + loss.detach()
        self.stats.add(ratio, step=record.t)
        return loss

    def train_rows(self, group: int, rows: list[TrainedRow]) -> list[torch.Tensor]:
        """Pipeline stages: the trained rows of a denoising step of the group's micro-batches, each forward and its
        immediate backward one micro-batch of megatron's 1F1B schedule (module doc); each row's gradient goes to
        its sample's provisional gradient on every stage. With the KL term each row is two micro-batches, each
        with its forward: the KL part into the group's accumulator, then the policy-gradient part (a 1F1B
        micro-batch has one backward, and the two parts must not be summed), the reference forwards, no grad,
        pipelined before them."""
        self._settle()  # the router finds the slot empty before each routed backward
        staged, sde, objective = pipelined(self.ctx.velocity_fn), self.ctx.sde, self.ctx.objective
        requests = [(row.latents, row.sigma, row.conditioning) for row in rows]
        kl_group = self._kl_group(group)
        reference = self.reference_velocities(requests) if objective.kl_beta > 0 else []
        parts = [(i, part) for i in range(len(rows)) for part in (("kl", "pg") if objective.kl_beta > 0 else ("pg",))]

        def loss_of(k: int, velocity: torch.Tensor) -> torch.Tensor:
            i, part = parts[k]
            record = rows[i].record(velocity)
            if part == "pg":
                return self._provisional((group, rows[i].loop, rows[i].row), record, record.train)
            ref_mean = sde.step(reference[i], record.latents, record.sigma, record.sigma_next,
                                prev_sample=record.next_latents).mean
            kl = kl_value(sde, objective, record.sde.mean, ref_mean, record.sde.std, record.sigma, record.sigma_next)
            return self._kl_part(kl_group, kl, record.train)

        keys = [("kl", kl_group) if part == "kl" else ("pg", group, rows[i].loop, rows[i].row) for i, part in parts]
        sync = self.ctx.grad_sync
        router = GradientRouter(sync, keys, self._open_slot, group=sync.ctx.pp_group)
        velocities = staged.trained(requests, [i for i, _ in parts], loss_of, router.route, sync,
                                    phases=PHASES, forward_context=self.ctx.precision)
        router.finish()
        self._track_buffers()
        return velocities

    def _open_slot(self, key: tuple) -> contextlib.AbstractContextManager:
        """The slot of a routed micro-batch (:meth:`train_rows`): ``("kl", group)`` the group's KL accumulator,
        ``("pg", group, micro-batch, row)`` the sample's provisional gradient."""
        if key[0] == "kl":
            return self._accumulating(self._kl, key[1])
        return self._accumulating(self._partial, key[1:])

    def _kl_group(self, index: int) -> int:
        """Key of the KL accumulator of group ``index``: its own, or the step's one with global std."""
        return -1 if self.plan.global_std else index

    # ------------------------------------------------------------------ rewards and advantages
    def on_rewards(self, key: UnitKey, rewards: torch.Tensor) -> None:
        """Affine mode: fold each sample's P_i into the group's R and S as soon as its reward is known."""
        if self.plan.accumulate != "affine":
            return
        self._settle()
        with self.ctx.phase("sync"):
            self._fold_affine(key, rewards)
        self._track_buffers()

    def _fold_affine(self, key: UnitKey, rewards: torch.Tensor) -> None:
        for row, reward in enumerate(rewards.double().tolist()):
            grads = self._take((*key, row))
            acc = self._affine.setdefault(key[0], [reward, None, None])
            if reward != acc[0]:
                acc[1] = grads_add_(acc[1], grads, reward - acc[0])
            acc[2] = grads if acc[2] is None else grads_add_(acc[2], grads)

    def _group_samples(self, group: GroupUpdate) -> list[tuple[tuple[int, int, int], float]]:
        """(sample key, local reward) of the group's samples, in micro-batch order."""
        return [((group.index, mb, row), float(r)) for mb, rewards in enumerate(group.rewards)
                for row, r in enumerate(rewards.double().tolist())]

    def _centred_sum(self, group: GroupUpdate) -> Optional[LocalGrads]:
        """Σ (r_i − mean_g)·P_i of the group (consumes its buffers)."""
        if self.plan.accumulate == "affine":
            shift, r_acc, s_acc = self._affine.pop(group.index, [0.0, None, None])
            terms = [(1.0, r_acc)] if r_acc is not None else []
            if s_acc is not None:
                terms.append((shift - group.group_mean, s_acc))
            return _scaled_sum(terms) if terms else None
        terms = [(reward - group.group_mean, self._take(key)) for key, reward in self._group_samples(group)]
        return _scaled_sum(terms) if terms else None

    def on_group_rewards(self, group: GroupUpdate) -> None:
        """Global std, clamp impossible: fold the group's mean-corrected gradient now."""
        if not self.plan.global_fold:
            return
        self._settle()
        with self.ctx.phase("sync"):
            centred = self._centred_sum(group)
        if centred is not None:
            self._folded = centred if self._folded is None else grads_add_(self._folded, centred)
        self._track_buffers()

    def _record_loss(self, group: GroupUpdate) -> None:
        """The group's loss: Σ_i A_i · (its unit-advantage loss), without a host sync."""
        for mb, adv in enumerate(group.advantages):
            for row, a in enumerate(adv.tolist()):
                unit = self._unit_loss.pop((group.index, mb, row), None)
                if unit is not None:
                    self.stats.losses.append(unit * a)

    def on_advantages(self, group: GroupUpdate) -> None:
        """Scale the group's provisional gradients by their advantages and reduce them (one collective)."""
        self._settle()
        self.stats.losses.extend(self._kl_losses.pop(self._kl_group(group.index), []))
        self._record_loss(group)
        if self.plan.global_fold:
            self._alpha = group.alpha
            return
        with self.ctx.phase("sync"):  # the correction belongs to the sync stage: correction → sync → accumulation
            self._reduce(self._corrected(group), self._kl_group(group.index))

    def _corrected(self, group: GroupUpdate) -> Optional[LocalGrads]:
        """Σ_i A_i·P_i of the group, formed before any cross-sample reduction (consumes the buffers)."""
        if self.plan.accumulate == "affine":
            if group.clamp_fired:
                raise RuntimeError("advantage clamp fired under affine accumulation (plan_reweight should prevent it)")
            shift, r_acc, s_acc = self._affine.pop(group.index, [0.0, None, None])
            terms = [(group.alpha, r_acc)] if r_acc is not None else []
            if s_acc is not None:
                terms.append((group.alpha * shift + group.gamma, s_acc))
        else:
            # a sample without a trained step (two experts: all its selected steps run the frozen one) has none
            terms = [(float(a), self._take((group.index, mb, row)))
                     for mb, (adv, traj) in enumerate(zip(group.advantages, group.trajectories))
                     for row, a in enumerate(adv.tolist()) if bool(traj.selected[row].any())]
        return _scaled_sum(terms) if terms else None

    def _take(self, sample: tuple[int, int, int]) -> LocalGrads:
        """The provisional gradient of ``sample`` (group, micro-batch, row), moved out; RoutingError when no
        backward was routed to it (reducing without it would train that sample with advantage 0)."""
        grads = self._partial.pop(sample, None)
        if grads is None:
            raise RoutingError(f"sample (group, micro-batch, row) {sample} has no provisional gradient: no backward "
                               f"was routed to it")
        return grads

    def _reduce(self, combined: Optional[LocalGrads], kl_group: Optional[int] = None) -> None:
        """Reduce ``combined`` with the KL accumulator of ``kl_group`` (None: with every one left)."""
        keys = sorted(self._kl) if kl_group is None else [kl_group]
        for key in keys:
            kl = self._kl.pop(key, None)
            if kl is not None:
                combined = kl if combined is None else grads_add_(combined, kl)
        sync = self.ctx.grad_sync
        if combined is None and kl_group is not None and sync.dense:  # the other ranks reduce this group: join
            combined = [None] * len(sync.params)
        if combined is not None:
            sync.reduce_local(self._to_slot(combined))

    def finish_update(self) -> UpdateStats:
        """Apply the global α to the folded sum, reduce what is left, publish the gradients."""
        self._settle()
        if self._partial or self._affine:
            raise RoutingError(f"Reweight update finished with provisional gradients that never got an advantage: "
                               f"samples {sorted(self._partial)}, affine groups {sorted(self._affine)}")
        for group in sorted(self._kl_losses):
            self.stats.losses.extend(self._kl_losses.pop(group))
        folded, self._folded = self._folded, None
        with self.ctx.phase("sync"):
            if folded is not None:
                if self._alpha is None:
                    raise RuntimeError("global-std fold finished without the global alpha")
                folded = _scaled_sum([(self._alpha, folded)])
            self._reduce(folded)
        return super().finish_update()
