"""The real training step of one rank at full size, simulated in one CPU process: its peak memory by category.

:func:`simulate_step` builds the configured policy exactly as training does (meta build, TP, FSDP2 wrapping,
activation checkpointing, the optimizer), on a *fake* process group of the planned world size (this process is
one rank; collectives cost nothing and move rank-local data), under :class:`~leangrpo_mcore.parallel.sim_mode.
SimulationMode`: large tensors are fake, small ones real. Then it runs the project's own step engine — rollout,
the schedule's update, gradient sync, clipping, the optimizer step — once, after one optimizer step on zero
gradients has created the optimizer state (so the measured step is a steady-state one), and reports the highest live memory of the rank, by category.

What does not run, and how it is accounted for:

- Text encoding happens before a step: the conditioning is built with the encoder's output shapes.
- Decoding and the reward need pixel values, which fake latents do not have: the rewards are fixed real numbers
  (distinct per sample, so advantages are non-zero), and the decoder and reward model are not part of the
  simulated peak (``not_simulated`` says so; the planner takes their memory as an input).
- Values read out of fake tensors (losses, ratio statistics, the gradient norm) are made up (``fake_reads``);
  none of them changes what the step allocates.

Categories at the peak: ``parameters`` (shards and gathered copies), ``gradients``, ``optimizer_state``,
``provisional_gradients`` (Reweight's per-sample buffers), ``retained_graphs`` (Retain's graphs kept from the
rollout), ``activations`` (tensors saved by grad-enabled forwards of an update), ``temporary`` (everything else:
no-grad forward scratch, collective buffers, the SDE state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.config import Config
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.parallel.sim_mode import SimulationMode, is_fake

CATEGORIES = ("parameters", "gradients", "optimizer_state", "provisional_gradients", "retained_graphs",
              "activations", "temporary")
NOT_SIMULATED = ("text encoding (before the step)", "latent decoding and the reward model (planner inputs)")


@dataclass
class Simulation:
    """One rank's simulated step."""

    peak_bytes: int
    """Highest live bytes of the rank during the measured step (everything it holds)."""
    step_peak_bytes: int
    """The same above the level at the measured step's start (what the step engine's memory meter reports)."""
    breakdown: dict[str, int]
    """Bytes by category at the peak (sums to :attr:`peak_bytes`)."""
    seconds: float
    """Wall-clock time of the simulation."""
    fake_reads: int
    """Python numbers read out of fake tensors (made up)."""
    not_simulated: tuple[str, ...] = NOT_SIMULATED
    notes: list[str] = field(default_factory=list)
    by_label: dict[str, int] = field(default_factory=dict)
    """Bytes at the peak by allocation label (the phase, ``:grad`` for grad-enabled forwards) or mark."""

    def as_json(self) -> dict:
        return {"simulated_peak_bytes": self.peak_bytes, "simulated_step_peak_bytes": self.step_peak_bytes,
                "simulated_breakdown": dict(self.breakdown), "simulated_seconds": round(self.seconds, 1),
                "simulated_fake_reads": self.fake_reads, "not_simulated": list(self.not_simulated),
                "simulation_notes": list(self.notes)}


@contextlib.contextmanager
def fake_world(world_size: int, tp: int, cp: int = 1, rank: int = 0) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (this process is ``rank``) and megatron's groups."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a simulation needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # megatron's gloo side groups cannot be built on a fake backend, and nothing here uses them
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                 create_gloo_process_groups=False)
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _conditioning(config: Config, hyper: dict, family: str, prompts: int) -> Conditioning:
    """Zeros in the shapes the configured text encoder gives ``prompts`` prompts."""
    from leangrpo_mcore.data.conditioning import TextDims
    from leangrpo_mcore.engine.build import HASHED_TEXT_LENGTH

    m, s = config.model, config.sampler
    length = HASHED_TEXT_LENGTH if m.text_encoder == "hashed" else m.text_max_length
    dims = TextDims.for_policy(family, hyper, max_length=length)
    tokens = torch.zeros(prompts, dims.max_length, dims.text_dim)
    pooled = None if dims.pooled_dim is None else torch.zeros(prompts, dims.pooled_dim)
    negative = torch.zeros_like(tokens) if s.cfg_scale > 1.0 else None
    guidance = torch.full((prompts,), s.guidance_scale) if hyper.get("guidance_embeds") else None
    return Conditioning(tokens, pooled, negative, guidance)


def _fixed_rewards(final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """Real, distinct rewards without reading the (fake) latents."""
    batch = final_latents.shape[0]
    return torch.arange(batch, dtype=torch.float32) * 0.25 + prompt_ids.float() * 0.5


class _Labeller:
    """Labels allocations by the step's phase and marks what the rank holds after every phase."""

    def __init__(self, sim: SimulationMode, engine, schedule: str) -> None:
        self.sim, self.engine, self.schedule = sim, engine, schedule
        self.stack: list[str] = []

    def __call__(self, name: str, entering: bool) -> None:
        if entering:
            self.stack.append(name)
        else:
            self.stack.pop()
            self.mark()
        self.sim.ledger.label = self.stack[-1] if self.stack else "other"

    def mark(self) -> None:
        ledger, engine = self.sim.ledger, self.engine
        ledger.mark(engine.policy.parameters(), "parameters")
        ledger.mark((p.grad for p in engine.policy.parameters() if p.grad is not None), "gradients")
        ledger.mark((t for state in engine.optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor)), "optimizer_state")
        if engine.active_schedule is not None:
            ledger.mark(engine.active_schedule.held_gradients(), "provisional_gradients")


def _category(label: str, schedule: str) -> str:
    """Category of an allocation label (``phase`` or ``phase:grad``) that no mark overrode."""
    if label in CATEGORIES:
        return label
    phase, _, grad = label.partition(":")
    if grad == "grad" and phase == "rollout":
        return "retained_graphs" if schedule == "retain" else "activations"
    if grad == "grad" and phase == "recompute":
        return "activations"
    return "temporary"


def _initialise_optimizer(sim: SimulationMode, engine) -> None:
    """The optimizer state a step after the first one starts with: one optimizer step on zero gradients."""
    from leangrpo_mcore.engine.optim import optimizer_step

    with sim.all_fake(), sim.ledger.labelled("optimizer"):
        for p in engine.params:
            p.grad = torch.zeros_like(p)
        optimizer_step(engine.optimizer, engine.params)


def simulate_step(config: Config, world_size: int, *, rank: int = 0, schedule: Optional[str] = None,
                  steps: int = 1, backend: str = "nccl") -> Simulation:
    """Simulate ``steps`` training steps of rank ``rank`` of ``config`` at ``world_size`` after an optimizer step
    that creates the optimizer state; the last is measured. ``backend`` is the collective backend whose internal
    buffers count (``nccl``: none; ``gloo``, to compare with a CPU run: its staging copies)."""
    from leangrpo_mcore.engine import build
    from leangrpo_mcore.engine.launch import DistContext
    from leangrpo_mcore.engine.step import StepInputs

    start = time.perf_counter()
    schedule = schedule or config.schedule.name
    with fake_world(world_size, config.parallel.tp, config.parallel.cp, rank):
        sim = SimulationMode(backend=backend)
        with sim:
            ledger = sim.ledger
            pctx = build.build_context(config, DistContext(rank, world_size, 0, torch.device("cpu"), "fake", False))
            with ledger.labelled("parameters"), sim.all_fake():
                parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx), fill_values=False)
            engine = build.build_engine(config, schedule, parts, pctx, _fixed_rewards)
            labeller = _Labeller(sim, engine, schedule)
            engine.phase_listener = labeller
            hyper = parts.policy.config.to_diffusers_config()
            cond = _conditioning(config, hyper, parts.family.name, config.grpo.prompts_per_step)
            ids = torch.arange(config.grpo.prompts_per_step)
            original = ledger.add

            def add(storage):  # the grad mode is part of an allocation's label
                label = ledger.label
                ledger.label = f"{label}:grad" if torch.is_grad_enabled() and label != "parameters" else label
                try:
                    original(storage)
                finally:
                    ledger.label = label
            ledger.add = add
            _initialise_optimizer(sim, engine)
            for step in range(steps):
                if step == steps - 1:
                    labeller.mark()
                    ledger.reset_peak()
                    level = ledger.total
                engine.step(StepInputs(step=step, conditioning=cond, prompt_ids=ids))
                labeller.mark()
            raw = ledger.at_peak()
            peak = ledger.peak
    breakdown = {name: 0 for name in CATEGORIES}
    for label, nbytes in raw.items():
        breakdown[_category(label, schedule)] += nbytes
    return Simulation(peak_bytes=peak, step_peak_bytes=peak - level, breakdown=breakdown,
                      seconds=time.perf_counter() - start, fake_reads=sim.fake_reads, by_label=raw)


BASE_BLOCKS = 2
"""Blocks of each kind in the smallest simulated policy of an extrapolation (one block of a kind would leave out
the transients of consecutive blocks: a block's gradients still being reduced while the next one's backward runs)."""


def block_counts(config: Config) -> dict[str, int]:
    """The policy's blocks by kind (FLUX: double- and single-stream; Wan: one kind), in diffusers' keys."""
    from leangrpo_mcore.engine.build import policy_hyper

    family, hyper = policy_hyper(config)
    keys = ("num_layers", "num_single_layers") if family.name == "flux" else ("num_layers",)
    return {key: int(hyper[key]) for key in keys}


def with_blocks(config: Config, counts: dict[str, int]) -> Config:
    """``config`` with the policy's block counts replaced (the architecture otherwise as configured)."""
    from leangrpo_mcore.engine.build import policy_hyper

    m = config.model
    arch = dict(m.arch)
    if m.path is not None:  # the architecture as the checkpoint states it; a simulation reads no weights
        family, hyper = policy_hyper(config)
        arch = {k: v for k, v in hyper.items() if not k.startswith("_")}
        m = dataclasses.replace(m, path=None, family=family.name, preset=None)
    return dataclasses.replace(config, model=dataclasses.replace(m, arch={**arch, **counts}))


def _combine(parts: list[tuple[float, Simulation]], seconds: float, note: str) -> Simulation:
    """The weighted sum of simulations (an affine extrapolation), category by category."""
    def total(get):
        return int(round(sum(w * get(s) for w, s in parts)))

    breakdown = {name: max(0, total(lambda s, n=name: s.breakdown[n])) for name in CATEGORIES}
    return Simulation(peak_bytes=sum(breakdown.values()), step_peak_bytes=total(lambda s: s.step_peak_bytes),
                      breakdown=breakdown, seconds=seconds, fake_reads=sum(s.fake_reads for _, s in parts),
                      notes=[note])


def simulate(config: Config, world_size: int, *, schedule: Optional[str] = None, rank: int = 0,
             backend: str = "nccl") -> Simulation:
    """One rank's steady-state step of ``config`` at ``world_size``.

    A policy small enough is simulated as it is. A full-size one is simulated with :data:`BASE_BLOCKS` blocks of
    each kind and with one more block of each kind in turn (widths, tokens, layout, schedule all as configured),
    and every category is extrapolated to the real block counts: beyond the transients of consecutive blocks,
    which the base already holds, memory is affine in the number of blocks of a kind, since blocks of a kind are
    identical in shape and are wrapped, gathered, checkpointed, retained and reduced one by one (tested against
    direct simulations). Fake-tensor dispatch costs the same per op at any width, so this is what keeps a
    12B-parameter candidate within minutes on a CPU.
    """
    start = time.perf_counter()
    counts = block_counts(config)
    extrapolated = len(counts) * (len(counts) * BASE_BLOCKS + 1)  # blocks simulated when extrapolating
    if sum(counts.values()) <= extrapolated or min(counts.values()) < BASE_BLOCKS:
        return simulate_step(config, world_size, schedule=schedule, rank=rank, backend=backend)
    base = {key: BASE_BLOCKS for key in counts}
    runs = [simulate_step(with_blocks(config, base), world_size, schedule=schedule, rank=rank,
                          backend=backend)]
    for key in counts:
        runs.append(simulate_step(with_blocks(config, {**base, key: BASE_BLOCKS + 1}), world_size,
                                  schedule=schedule, rank=rank, backend=backend))
    # peak(n) = peak(base) + sum over kinds k of (n_k - base) * (peak(base + one block of kind k) - peak(base))
    extra = {key: counts[key] - BASE_BLOCKS for key in counts}
    weights = [(1.0 - sum(extra.values()), runs[0])] + [(float(extra[key]), sim) for key, sim in zip(counts, runs[1:])]
    shown = ", ".join(f"{k}={v}" for k, v in counts.items())
    return _combine(weights, time.perf_counter() - start,
                    f"extrapolated to {shown} from simulations with {BASE_BLOCKS} and {BASE_BLOCKS + 1} blocks "
                    "of each kind")
