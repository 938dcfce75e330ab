"""The real training step of one rank at full size, simulated in one CPU process: its peak memory by category.

:func:`simulate_step` builds the configured policy exactly as training does (meta build, TP, FSDP2 wrapping,
activation checkpointing, the optimizer), on a *fake* process group of the planned world size (this process is
one rank; collectives cost nothing and move rank-local data), under :class:`~leangrpo_mcore.planner.sim_mode.
SimulationMode`: large tensors are fake, small ones real. Then it runs the project's own step engine — rollout,
the schedule's update, gradient sync, clipping, the optimizer step — once, after one optimizer step on zero
gradients has created the optimizer state (so the measured step is a steady-state one), and reports the highest live memory of the rank, by category.

What does not run, and how it is accounted for:

- Text encoding happens before a step: the conditioning is built with the encoder's output shapes, and with
  ``data.images`` with the shapes of the encoded conditioning image (its reading and VAE encoding are not run).
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
import functools
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.config import Config
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.planner.sim_mode import SimulationMode, is_fake

CATEGORIES = ("parameters", "gradients", "optimizer_state", "provisional_gradients", "retained_graphs",
              "activations", "temporary")
ROLLOUT_PHASES = ("rollout", "reward", "advantage")
"""Phases of a step counted toward its rollout region (the rest toward its update region): Retain's graphs
build up in the first and are consumed in the second, and only the first scales with the trained steps."""
FIRST_BACKWARD = "update_first_backward"
"""Retain's update region up to the end of its first backward."""
NOT_SIMULATED = ("text encoding (before the step)",
                 "latent decoding and the reward model (the planner's terms; the resident model is added as predicted)")


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
    regions: dict[str, dict[str, int]] = field(default_factory=dict)
    """Breakdown at the peak of each region of the step (rollout, update)."""
    level: int = 0
    """Live bytes at the measured step's start."""
    peak_region: str = ""
    """The region of the highest peak."""

    def as_json(self) -> dict:
        return {"simulated_peak_bytes": self.peak_bytes, "simulated_step_peak_bytes": self.step_peak_bytes,
                "simulated_breakdown": dict(self.breakdown), "simulated_seconds": round(self.seconds, 1),
                "simulated_fake_reads": self.fake_reads, "simulated_peak_region": self.peak_region,
                "not_simulated": list(self.not_simulated),
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


def _conditioning(config: Config, hyper: dict, family: str, prompts: int,
                  latent_shape: tuple[int, ...]) -> Conditioning:
    """Zeros in the shapes the configured text encoder (and with ``data.images`` the family's reference encoder)
    gives ``prompts`` prompts."""
    from leangrpo_mcore.data.conditioning import TextDims
    from leangrpo_mcore.data.reference import ReferenceRun, reference_shapes
    from leangrpo_mcore.engine.build import HASHED_TEXT_LENGTH

    m, s = config.model, config.sampler
    length = HASHED_TEXT_LENGTH if m.text_encoder == "hashed" else m.text_max_length
    dims = TextDims.for_policy(family, hyper, max_length=length)
    tokens = torch.zeros(prompts, dims.max_length, dims.text_dim)
    pooled = None if dims.pooled_dim is None else torch.zeros(prompts, dims.pooled_dim)
    negative = torch.zeros_like(tokens) if s.cfg_scale > 1.0 else None
    guidance = torch.full((prompts,), s.guidance_scale) if hyper.get("guidance_embeds") else None
    # SD3's guidance also reads the negative prompt's pooled vector
    negative_pooled = torch.zeros_like(pooled) if negative is not None and family == "sd3" else None
    run = ReferenceRun(hyper=dict(hyper), frames=s.frames, image_encoder_path=m.image_encoder_path, reads_weights=False)
    references = {name: torch.zeros(prompts, *shape)
                  for name, shape in reference_shapes(family, latent_shape, run).items()} if config.data.images else {}
    return Conditioning(tokens, pooled, negative, guidance, negative_pooled, **references)


def _fixed_rewards(final_latents: torch.Tensor, prompt_ids: torch.Tensor, components: int = 0) -> torch.Tensor:
    """Real, distinct rewards without reading the (fake) latents; (B, components) for reward.aggregate=advantages."""
    batch = final_latents.shape[0]
    rewards = torch.arange(batch, dtype=torch.float32) * 0.25 + prompt_ids.float() * 0.5
    return rewards[:, None] * torch.arange(1, components + 1, dtype=torch.float32) if components else rewards


class _Labeller:
    """Labels allocations by the step's phase and marks what the rank holds after every phase."""

    def __init__(self, sim: SimulationMode, engine, schedule: str) -> None:
        self.sim, self.engine, self.schedule = sim, engine, schedule
        self.stack: list[str] = []
        self.backward_done = False

    def __call__(self, name: str, entering: bool) -> None:
        if entering:
            self.stack.append(name)
        else:
            if self.stack.pop() == "backward" and self.sim.ledger.region == FIRST_BACKWARD:
                self.backward_done = True
            self.mark()
        phase = self.stack[-1] if self.stack else "other"
        self.sim.ledger.label = phase
        if phase in ROLLOUT_PHASES:
            region = "rollout"
            if phase == "rollout":  # a new group's graphs: its first backward comes again
                self.backward_done = False
        elif not self.stack:
            region = "other"
        else:
            # Retain: the update's first backward runs while every other kept graph still exists (its own region,
            # so that those graphs can be scaled to |S| there too); the graphs only shrink after it.
            region = FIRST_BACKWARD if self.schedule == "retain" and not self.backward_done else "update"
        if region != self.sim.ledger.region:
            self.sim.ledger.enter(region)

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
    from leangrpo_mcore.engine.model_source import resolve_model_source
    from leangrpo_mcore.engine.step import StepInputs

    start = time.perf_counter()
    source = resolve_model_source(config, check=False)  # fake tensors: no weights are read, none are trained
    schedule = schedule or config.schedule.name
    with fake_world(world_size, config.parallel.tp, config.parallel.cp, rank):
        sim = SimulationMode(backend=backend)
        with sim:
            ledger = sim.ledger
            pctx = build.build_context(config, DistContext(rank, world_size, 0, torch.device("cpu"), "fake", False))
            # a simulation reads no weights: a full-size preset needs no model.path here
            source = resolve_model_source(config, check=False)
            with ledger.labelled("parameters"), sim.all_fake():
                parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx), source=source,
                                                 fill_values=False)
            components = len(config.reward.weights or {}) if config.reward.aggregate == "advantages" else 0
            engine = build.build_engine(config, schedule, parts, pctx,
                                        functools.partial(_fixed_rewards, components=components))
            labeller = _Labeller(sim, engine, schedule)
            engine.phase_listener = labeller
            hyper = parts.policy.config.to_diffusers_config()
            cond = _conditioning(config, hyper, parts.family.name, config.grpo.prompts_per_step,
                                 engine.plan.latent_shape)
            ids = torch.arange(config.grpo.prompts_per_step)
            ledger.tag_grad = True  # the grad mode is part of an allocation's label from here on
            _initialise_optimizer(sim, engine)
            for step in range(steps):
                if step == steps - 1:
                    labeller.mark()
                    ledger.reset_peak()
                    level = ledger.total
                engine.step(StepInputs(step=step, conditioning=cond, prompt_ids=ids))
                labeller.mark()
            regions = {region: _categorised(ledger.at_peak(region), schedule) for region in ledger.peaks}
    return _result(regions, level, time.perf_counter() - start, sim.fake_reads)


def _categorised(raw: dict[str, int], schedule: str) -> dict[str, int]:
    breakdown = {name: 0 for name in CATEGORIES}
    for label, nbytes in raw.items():
        breakdown[_category(label, schedule)] += nbytes
    return breakdown


def _result(regions: dict[str, dict[str, int]], level: int, seconds: float, fake_reads: int,
            notes: Optional[list[str]] = None) -> Simulation:
    """The simulation whose peak is the highest of its regions' peaks."""
    region = max(regions, key=lambda r: sum(regions[r].values()))
    peak = sum(regions[region].values())
    return Simulation(peak_bytes=peak, step_peak_bytes=peak - level, breakdown=dict(regions[region]),
                      seconds=seconds, fake_reads=fake_reads, notes=list(notes or []), regions=regions, level=level,
                      peak_region=region)


BASE_BLOCKS = 3
"""Blocks of each kind in the smallest simulated policy of an extrapolation. Fewer would leave out transients of
consecutive blocks (one block's gradients still being reduced while the next one's backward runs): measured on
FLUX.1-dev's widths, the temporaries at the peak grow from 2 to 3 double blocks and not after."""
SIM_STEPS = 2
"""Trained steps of a simulated rollout (at most; one untrained step more where the config has one after them)."""


def block_counts(config: Config) -> dict[str, int]:
    """The policy's blocks by kind (FLUX: double- and single-stream; Wan: one kind; SD3: MMDiT-X blocks and the
    plain joint ones, see :func:`sd3_blocks`), in diffusers' keys."""
    from leangrpo_mcore.engine.model_source import resolve_model_source

    source = resolve_model_source(config, check=False)  # a simulation never needs weights
    family, hyper = source.family, source.hyper
    if family.name == "sd3":
        dual = len(hyper.get("dual_attention_layers") or ())
        return {SD3_DUAL_KEY: dual, "num_layers": int(hyper["num_layers"]) - dual}
    keys = ("num_layers", "num_single_layers") if family.name == "flux" else ("num_layers",)
    return {key: int(hyper[key]) for key in keys}


SD3_DUAL_KEY = "dual_attention_layers"
"""SD3's MMDiT-X blocks by count (diffusers lists their indices): the first ones, as in SD3.5-M."""


def sd3_blocks(counts: dict[str, int]) -> dict:
    """SD3's diffusers keys for ``counts`` of :func:`block_counts`: the MMDiT-X blocks first, then the plain ones
    (the context-pre-only last block among them)."""
    dual = counts[SD3_DUAL_KEY]
    return {"num_layers": dual + counts["num_layers"], SD3_DUAL_KEY: list(range(dual))}


def with_blocks(config: Config, counts: dict[str, int]) -> Config:
    """``config`` with the policy's block counts replaced (the architecture otherwise as configured)."""
    from leangrpo_mcore.engine.model_source import resolve_model_source

    m = config.model
    arch = dict(m.arch)
    if m.path is not None:  # the architecture as the checkpoint states it; a simulation reads no weights
        source = resolve_model_source(config, check=False)
        family, hyper = source.family, source.hyper
        arch = {k: v for k, v in hyper.items() if not k.startswith("_")}
        m = dataclasses.replace(m, path=None, family=family.name, preset=None)
    blocks = sd3_blocks(counts) if m.family == "sd3" else counts
    return dataclasses.replace(config, model=dataclasses.replace(m, arch={**arch, **blocks}))


def selected_steps(config: Config) -> int:
    """The trained steps of a sample of ``config``: |S|, or with one expert of two trained those of its steps
    that expert runs (the planner's count)."""
    from leangrpo_mcore.planner.config_workload import arch_of, trained_steps_of

    return trained_steps_of(config, arch_of(config))


def with_steps(config: Config) -> tuple[Config, float]:
    """``config`` with at most :data:`SIM_STEPS` denoising steps, and the factor by which its retained graphs
    scale to the configured |S| (1 when nothing changed). Per denoising step a step allocates and frees the
    same: only Retain's graphs, one per trained step, add up over the steps."""
    s, g = config.sampler, config.grpo
    if s.num_steps <= SIM_STEPS or g.timestep_selection not in ("flow_grpo", "dance_grpo"):
        return config, 1.0
    if config.model.experts.train != "both":
        return _with_expert_steps(config)
    want = selected_steps(config)
    steps = SIM_STEPS
    if g.timestep_selection == "flow_grpo":
        # the first |S| steps train; keep an untrained step after them if there is one (its forward runs on top of
        # every kept graph)
        fewer = max(1, min(want, SIM_STEPS))
        steps = fewer + (1 if want < s.num_steps else 0)
        fraction = min(1.0, (fewer + 0.5) / steps)  # int(steps * fraction) == fewer
    else:  # dance_grpo: trained steps among the first T - 1, the last never trains
        fewer = max(1, min(want, SIM_STEPS - 1))
        fraction = min(1.0, (fewer + 0.5) / (SIM_STEPS - 1))
    if steps >= s.num_steps:
        return config, 1.0
    reduced = dataclasses.replace(config, sampler=dataclasses.replace(s, num_steps=steps),
                                  grpo=dataclasses.replace(g, timestep_fraction=fraction))
    return reduced, want / fewer


def _with_expert_steps(config: Config) -> tuple[Config, float]:
    """:func:`with_steps` of a two-expert policy training one expert: a rollout as short as keeps a step of each
    expert and every candidate step selected (FlowGRPO: 2 steps, DanceGRPO: 3 with the last never trained), so that
    exactly one step trains (its expert's); ``config`` itself where that does not come out."""
    from leangrpo_mcore.diffusion.selection import ExpertSteps
    from leangrpo_mcore.diffusion.sigmas import get_sigmas
    from leangrpo_mcore.engine.model_source import sampler_shift
    from leangrpo_mcore.planner.config_workload import arch_of

    s, g = config.sampler, config.grpo
    steps = SIM_STEPS + (1 if g.timestep_selection == "dance_grpo" else 0)
    if steps >= s.num_steps:
        return config, 1.0
    ratio = float(arch_of(config).config["boundary_ratio"])
    trained = ExpertSteps(ratio * 1000, s.sigma_schedule, config.model.experts.train).trained(
        get_sigmas(s.sigma_schedule, steps, shift=sampler_shift(config)))
    if int(trained[:SIM_STEPS].sum()) != 1:  # the candidate steps: the first two
        return config, 1.0
    reduced = dataclasses.replace(config, sampler=dataclasses.replace(s, num_steps=steps),
                                  grpo=dataclasses.replace(g, timestep_fraction=1.0))
    return reduced, float(selected_steps(config))


def _scaled(sim: Simulation, graphs: float) -> Simulation:
    """``sim`` with Retain's graphs scaled by ``graphs`` (simulated trained steps to |S|): at the rollout's peak
    all of them are kept (scaled by ``graphs``); during the update's first backward the graphs of the trained
    steps the reduced rollout left out are all still kept (added); after it the graphs only shrink while the
    gradients stay, so the rest of the update is left as it is."""
    if graphs == 1.0 or "rollout" not in sim.regions:
        return sim
    regions = {name: dict(b) for name, b in sim.regions.items()}
    rollout = regions["rollout"]
    kept = rollout["retained_graphs"]
    rollout["retained_graphs"] = int(round(kept * graphs))
    if FIRST_BACKWARD in regions:
        regions[FIRST_BACKWARD]["retained_graphs"] += int(round(kept * (graphs - 1)))
    return _result(regions, sim.level, sim.seconds, sim.fake_reads, sim.notes)


def _combine(parts: list[tuple[float, Simulation]], seconds: float, notes: list[str]) -> Simulation:
    """The weighted sum of simulations (an affine extrapolation), region by region and category by category."""
    names = set.intersection(*(set(sim.regions) for _, sim in parts))
    regions = {name: {c: max(0, int(round(sum(w * sim.regions[name][c] for w, sim in parts)))) for c in CATEGORIES}
               for name in names}
    level = int(round(sum(w * sim.level for w, sim in parts)))
    return _result(regions, level, seconds, sum(sim.fake_reads for _, sim in parts), notes)


def simulate(config: Config, world_size: int, *, schedule: Optional[str] = None, rank: int = 0,
             backend: str = "nccl") -> Simulation:
    """One rank's steady-state step of ``config`` at ``world_size``.

    A small config is simulated as it is. A full-size one is simulated smaller in two directions, and every
    category of the peak is carried over to the real sizes:

    - Blocks: with :data:`BASE_BLOCKS` blocks of each kind and with one more block of each kind in turn (widths,
      tokens, layout, schedule all as configured). Beyond the transients of consecutive blocks, which the base
      already holds, memory is affine in the number of blocks of a kind: blocks of a kind are identical in shape
      and are wrapped, gathered, checkpointed, retained and reduced one by one.
    - Denoising steps: a rollout of :data:`SIM_STEPS` steps. A step allocates and frees the same at every
      denoising step; only Retain's graphs, one per trained step, add up, and they are scaled to |S|.

    Both reductions are tested against direct simulations. Fake-tensor dispatch costs the same per op at any
    width, so this is what keeps a 12B-parameter candidate within minutes on a CPU.
    """
    start = time.perf_counter()
    counts = block_counts(config)
    small, graphs = with_steps(config)
    run = functools.partial(simulate_step, world_size=world_size, schedule=schedule, rank=rank, backend=backend)
    extrapolated = len(counts) * (len(counts) * BASE_BLOCKS + 1)  # blocks simulated when extrapolating
    notes = [] if small is config else [f"simulated with {small.sampler.num_steps} denoising steps; retained "
                                        f"graphs scaled by {graphs:g} to |S|={selected_steps(config)}"]
    if sum(counts.values()) <= extrapolated or min(counts.values()) < BASE_BLOCKS:
        sim = _scaled(run(small), graphs)
        sim.notes.extend(notes)
        sim.seconds = time.perf_counter() - start
        return sim
    base = {key: BASE_BLOCKS for key in counts}
    runs = [_scaled(run(with_blocks(small, base)), graphs)]
    for key in counts:
        runs.append(_scaled(run(with_blocks(small, {**base, key: BASE_BLOCKS + 1})), graphs))
    # peak(n) = peak(base) + sum over kinds k of (n_k - base) * (peak(base + one block of kind k) - peak(base))
    extra = {key: counts[key] - BASE_BLOCKS for key in counts}
    weights = [(1.0 - sum(extra.values()), runs[0])] + [(float(extra[key]), sim) for key, sim in zip(counts, runs[1:])]
    shown = ", ".join(f"{k}={v}" for k, v in counts.items())
    notes.append(f"extrapolated to {shown} from simulations with {BASE_BLOCKS} and {BASE_BLOCKS + 1} blocks of "
                 "each kind")
    return _combine(weights, time.perf_counter() - start, notes)
