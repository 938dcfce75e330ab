"""``leangrpo-plan --simulate``: the planner's candidates run as real steps under fake tensors.

A candidate (schedule, TP / FSDP degrees, activation checkpointing) of an experiment becomes a :class:`Config`
(the YAML config as written, or the config the command-line flags describe) and is simulated by
:func:`leangrpo_mcore.planner.simulate.simulate`. What the planner counts and a simulation cannot hold — the
per-GPU overhead outside tensors and the resident reward model (a planner input, or derived from the reward's
architecture) — is added to the simulated peak as ``reserved``, so that ``simulated_peak_bytes`` compares
directly with ``peak_mem_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from leangrpo_mcore.config import Config
from leangrpo_mcore.config.loader import build_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.gathering import reshard_value
from leangrpo_mcore.planner.arch_specs import BUILTIN_PRESETS
from leangrpo_mcore.planner.cost_model import Estimate
from leangrpo_mcore.planner.layout import Plan
from leangrpo_mcore.planner.workload import SCHEDULES, Workload

SIMULATE_CHOICES = ("chosen", "all")
BASE_PRESET = {"flux": "flux-dev", "sd3": "sd3.5-medium", "wan": "wan2.1-1.3b", "qwen_image": "qwen-image"}
"""Preset under a diffusers config's own hyper-parameters (every one of them overrides it)."""
SIGMA_SCHEDULE = {"flux": "flux", "sd3": "sd3", "wan": "wan", "qwen_image": "qwen_image"}
"""The sigma schedule of each family's pipeline."""
DEFAULT_SHIFT = 3.0
"""The static shift of a flag-described run (the trainer's default without a pipeline's scheduler config)."""


def flags_config(work: Workload, *, height: int, width: int, frames: int, cfg_scale: float) -> Config:
    """The experiment config that ``leangrpo-plan``'s flags describe (for a preset or a diffusers config)."""
    arch = work.arch
    fraction = min(1.0, (_selected_of(work) + 0.5) / work.num_steps)  # int(T * fraction) == |S|
    wan = arch.family == "wan"
    data = {
        "model": {"family": arch.family, "preset": arch.name if arch.name in BUILTIN_PRESETS else BASE_PRESET[arch.family],
                  "arch": {k: v for k, v in arch.config.items() if not k.startswith("_")}, "backend": "local",
                  "dtype": "float32" if work.precision.compute_bytes == 4 else "bfloat16",
                  "master_dtype": "float32", "text_encoder": "diffusers", "vae": "tiny",
                  "text_max_length": int(work.tokens["text"]),
                  "lora": {"rank": work.lora_rank, "alpha": 2 * max(work.lora_rank, 1),
                           "targets": list(work.lora_targets) or None},
                  "experts": {"train": work.experts_train}},
        "sampler": {"sde_kind": "wan" if wan else "flow_grpo", "sigma_schedule": SIGMA_SCHEDULE[arch.family],
                    "num_steps": work.num_steps, "height": height, "width": width, "frames": frames,
                    "cfg_scale": cfg_scale},
        "grpo": {"group_size": work.group_size, "prompts_per_step": work.prompts_per_step,
                 "timestep_selection": work.selection, "timestep_fraction": fraction, "kl_beta": work.kl_beta,
                 "updates_per_rollout": work.updates_per_rollout, "global_std": work.global_std},
        "schedule": {"name": "native", "micro_batch": work.micro_batch,
                     "reweight_accumulate": work.reweight_accumulate},
        "parallel": {"layout": work.layout, "reshard_after_forward": work.reshard_after_forward,
                     "reduce_dtype": "float32" if work.precision.buffer_bytes == 4 else "bfloat16"},
        "optim": {"name": work.optimizer},
        "data": {"images": work.tokens.get("reference", 0) > 0 or _reads_channels(work)},
    }
    return build_config(data)


def _reads_channels(work: Workload) -> bool:
    """Whether the policy reads a conditioning image through its input channels (Wan's I2V checkpoints)."""
    c = work.arch.config
    return work.arch.family == "wan" and int(c["in_channels"]) > int(c.get("out_channels") or c["in_channels"])


def _selected_of(work: Workload) -> int:
    """The first steps to select so that the trained ones are the workload's |S| (with one expert of two trained,
    |S| counts that expert's steps only: ``leangrpo-plan --experts-train``)."""
    if work.experts_train == "both":
        return work.selected_steps
    from leangrpo_mcore.planner.config_workload import expert_trained_steps

    for first in range(1, work.num_steps + 1):
        if expert_trained_steps(work.arch, work.experts_train, SIGMA_SCHEDULE[work.arch.family], work.num_steps,
                                DEFAULT_SHIFT, "flow_grpo", first) >= work.selected_steps:
            return first
    return work.num_steps


def candidate_config(config: Config, est: Estimate) -> Config:
    """``config`` with the candidate's schedule, parallel degrees, FSDP2 gathering and activation checkpointing."""
    if config.model.fp8 is not None:
        raise UserError("--simulate runs on the CPU without Transformer Engine: simulate the bf16 equivalent "
                        "(model.fp8=null); the planner budgets FP8 activations as bf16 too")
    parallel = dataclasses.replace(config.parallel, tp=est.layout.tp, cp=est.layout.cp,
                                   dp_shard=est.layout.dp_shard, dp_replicate=est.layout.dp_replicate,
                                   reshard_after_forward=reshard_value(est.gather_mode))
    model = dataclasses.replace(config.model, backend="local", activation_checkpointing=est.activation_checkpointing)
    schedule = dataclasses.replace(config.schedule, name=est.schedule)
    return dataclasses.replace(config, parallel=parallel, model=model, schedule=schedule)


def targets(plan: Plan, which: str) -> list[int]:
    """Indices of the candidates to simulate: the chosen one, or the best feasible one of each schedule."""
    if which not in SIMULATE_CHOICES:
        raise UserError(f"--simulate takes {' or '.join(SIMULATE_CHOICES)}, not {which!r}")
    if which == "chosen":
        if plan.chosen is None:
            raise UserError("--simulate chosen: nothing fits, so nothing is chosen (use --simulate all)")
        if plan.chosen.layout.pp > 1:
            raise UserError(f"--simulate runs one rank of the whole policy and does not simulate pipeline stages; "
                            f"the chosen layout has pp={plan.chosen.layout.pp} (plan with --pp 1, or --simulate "
                            f"all for the best pp=1 candidate of each schedule)")
        return [plan.candidates.index(plan.chosen)]
    out = []
    for schedule in SCHEDULES:  # the simulator runs the whole policy on one rank: pp = 1 candidates only
        best = next((i for i, c in enumerate(plan.candidates) if c.schedule == schedule and c.feasible
                     and c.layout.pp == 1), None)
        if best is not None:
            out.append(best)
    return out


def simulate_candidate(config: Config, est: Estimate, plan: Plan) -> dict:
    """The simulation of one candidate, as the JSON fields added next to its prediction."""
    import warnings

    from leangrpo_mcore.planner.simulate import simulate

    with warnings.catch_warnings():
        # what the simulated step warns about is the training run's business (FSDP2's note on a view output,
        # megatron's missing optional kernels), not the plan's
        warnings.simplefilter("ignore", UserWarning)
        sim = simulate(candidate_config(config, est), plan.hardware.world_size, schedule=est.schedule)
    reserved = int(est.memory.get("reserved", 0)) + int(est.memory.get("reward_model", 0))
    out = sim.as_json()
    out["simulated_breakdown"]["reserved"] = reserved
    out["simulated_peak_bytes"] = sim.peak_bytes + reserved
    predicted = est.peak_mem_bytes
    out["simulated_over_predicted"] = round(out["simulated_peak_bytes"] / predicted, 4) if predicted else None
    return out


def simulate_plan(plan: Plan, config: Config, which: str, progress: Optional[callable] = None) -> dict[int, dict]:
    """``{candidate index: simulation fields}`` for :func:`targets`."""
    chosen = targets(plan, which)
    results = {}
    for n, index in enumerate(chosen):
        est = plan.candidates[index]
        if progress is not None:
            progress(f"simulating {n + 1}/{len(chosen)}: {est.schedule} tp={est.layout.tp} cp={est.layout.cp} "
                     f"dp_shard={est.layout.dp_shard} dp_replicate={est.layout.dp_replicate} "
                     f"checkpointing={'on' if est.activation_checkpointing else 'off'}")
        results[index] = simulate_candidate(config, est, plan)
    return results
