"""The layout planner: pick the schedule, PP / TP / CP / FSDP / HSDP degrees and the placement of prompt groups.

Pure Python (no torch.distributed). Candidates are every pipeline-parallel size whose stages are whole nodes or
divide a node (pp outermost, at most one stage per block), every TP size dividing both the attention heads and
the GPUs of a stage in a node, every CP (context-parallel) size dividing the heads per TP rank with TP x CP inside
a node (at every pp, as the trainer runs it), every FSDP shard degree filling part or all of the rest of a
node, HSDP replicas across the remaining GPUs of a stage, each schedule (Native, Retain, Reweight) and, unless
the experiment fixes them, activation checkpointing on and off and the FSDP2 gathering modes (per forward, once
per rollout, once per step).
:mod:`leangrpo_mcore.planner.cost_model` predicts each candidate's peak memory and step time; the fastest that
fits wins, and the plan explains the choice against the best of the other schedules (and, with CP > 1, against
CP = 1). When nothing fits the plan refuses, naming the smallest peak and what dominates it.

:func:`plan_for_config` is what the trainer calls to resolve a config's ``auto`` keys (the plan's words:
:mod:`leangrpo_mcore.planner.plan_words`); :func:`predict_memory` gives the
predicted peak of each schedule for a config as written (for comparing with a measured peak).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import lora_params, lora_params_per_rank, param_counts, params_per_rank, stage_spec
from leangrpo_mcore.planner.config_workload import (  # noqa: F401 (the config entry points, re-exported)
    DEFAULT_TEXT_TOKENS,
    HASHED_TEXT_TOKENS,
    precision_from_config,
    workload_from_config,
)
from leangrpo_mcore.planner.cost_model import Estimate, estimate
from leangrpo_mcore.planner.plan_words import (  # noqa: F401 (describe_layout and pp_words, re-exported)
    cp_words,
    describe_layout,
    explain,
    pp_words,
    refusal,
    reweight_words,
    run_words,
)
from leangrpo_mcore.planner.placement import Placement, place
from leangrpo_mcore.planner.workload import SCHEDULES, GiB, Hardware, Layout, Workload
from leangrpo_mcore.parallel.gathering import GATHER_MODES, reshard_value


class PlanError(UserError):
    """No candidate layout fits (the message says why)."""


@dataclass
class Plan:
    """The planner's answer: the choice (or a refusal), every candidate, and the rank placement."""

    schedule: Optional[str]
    reason: str
    chosen: Optional[Estimate]
    candidates: list[Estimate]
    placement: Optional[Placement]
    hardware: Hardware
    workload: Workload

    @property
    def ok(self) -> bool:
        """True when some candidate fits."""
        return self.chosen is not None

    @property
    def layout(self) -> Optional[Layout]:
        """The chosen parallel degrees."""
        return self.chosen.layout if self.chosen else None

    def require(self) -> "Plan":
        """This plan, or :class:`PlanError` with the refusal's reason."""
        if not self.ok:
            raise PlanError(self.reason)
        return self

    @property
    def overrides(self) -> Optional[str]:
        """The chosen plan as one line of config overrides (:func:`override_line`), None when nothing fits."""
        return None if self.chosen is None else override_line(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``schedule``, ``reason``, ``candidates``, ``placement``, the chosen layout and its
        ``overrides`` line."""
        chosen = None if self.chosen is None else candidate_dict(self.chosen, self.workload)
        return {"schedule": self.schedule, "reason": self.reason, "chosen": chosen, "overrides": self.overrides,
                "candidates": [candidate_dict(c, self.workload) for c in self.candidates],
                "placement": None if self.placement is None else self.placement.to_dict(),
                "world_size": self.hardware.world_size, "gpu_mem_bytes": self.hardware.gpu_mem_bytes}


def parameter_counts(work: Workload, layout: Layout) -> dict[str, int]:
    """The policy's parameters, ``total`` and ``trainable`` (the adapters under LoRA, which ``total`` includes),
    and what one rank stores of them after TP, the pipeline stages and FSDP2's ``dp_shard x cp`` sharding:
    ``per_rank`` and ``trainable_per_rank``, on the rank of the largest stage."""
    arch, full = work.arch, work.full_finetune
    adapters = 0 if full else lora_params(arch, work.lora_rank, work.lora_targets)["total"]
    total = param_counts(arch)["total"] + adapters
    per_rank = trainable_per_rank = 0
    for stage in range(layout.pp):
        part = stage_spec(arch, layout.pp, stage)
        held_adapters = 0 if full else lora_params_per_rank(part, work.lora_rank, work.lora_targets, layout.tp)
        held = params_per_rank(part, layout.tp) + held_adapters
        per_rank = max(per_rank, -(-held // layout.shard_ranks))
        trainable_per_rank = max(trainable_per_rank, -(-(held if full else held_adapters) // layout.shard_ranks))
    return {"total": total, "trainable": total if full else adapters, "per_rank": per_rank,
            "trainable_per_rank": trainable_per_rank}


def candidate_dict(est: Estimate, work: Workload) -> dict[str, Any]:
    """One candidate as JSON: the documented JSON keys plus checkpointing, shape, parameters and notes."""
    shape = est.shape
    return {
        "schedule": est.schedule, "pp": est.layout.pp, "tp": est.layout.tp, "cp": est.layout.cp,
        "dp_shard": est.layout.dp_shard,
        "dp_replicate": est.layout.dp_replicate, "activation_checkpointing": est.activation_checkpointing,
        "reshard_after_forward": reshard_value(est.gather_mode), "gather_mode": est.gather_mode,
        "generations_per_rank": shape.generations_per_rank if shape else None,
        "worker_groups": shape.worker_groups if shape else None,
        "peak_mem_bytes": est.peak_mem_bytes if est.feasible else None, "fits": est.fits,
        "feasible": est.feasible, "step_time_s": est.step_time_s if est.feasible else None,
        "max_selected_steps": est.max_selected_steps, "note": est.note, "details": dict(est.details),
        "parameters": parameter_counts(work, est.layout),
        "breakdown": {"time_s": dict(est.time), "memory_bytes": dict(est.memory), "peak_phase": est.peak_phase},
    }


def override_values(est: Estimate) -> dict[str, Any]:
    """The config values that run candidate ``est``: schedule, every parallel degree, the FSDP2 gathering and
    activation checkpointing (dotted keys)."""
    lay = est.layout
    return {"schedule.name": est.schedule, "parallel.tp": lay.tp, "parallel.pp": lay.pp, "parallel.cp": lay.cp,
            "parallel.dp_shard": lay.dp_shard, "parallel.dp_replicate": lay.dp_replicate,
            "parallel.reshard_after_forward": reshard_value(est.gather_mode),
            "model.activation_checkpointing": est.activation_checkpointing}


def override_line(est: Estimate) -> str:
    """``schedule.name=… parallel.tp=… … model.activation_checkpointing=…``: the overrides that run ``est``."""
    def text(value: Any) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"{key}={text(value)}" for key, value in override_values(est).items())


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_cp(cp: int, num_heads: int, hw: Hardware, tp: Optional[int] = None) -> None:
    """One-line UserError unless a CP group of ``cp`` ranks can split the heads (per TP rank) inside a node."""
    g = hw.gpus_per_node
    if cp < 1:
        raise UserError(f"cp must be >= 1, got {cp}")
    if g % cp:
        raise UserError(f"cp={cp} does not divide the {g} GPUs per node (a CP group stays inside a node)")
    if tp is not None and (g % (tp * cp) or num_heads % (tp * cp)):
        raise UserError(f"cp={cp} with tp={tp}: tp x cp must divide both the {g} GPUs per node and the "
                        f"{num_heads} attention heads")
    if num_heads % cp:
        raise UserError(f"cp={cp} does not divide the {num_heads} attention heads (Ulysses splits the heads)")


def pipeline_sizes(hw: Hardware, num_layers: int) -> list[int]:
    """Pipeline-parallel sizes the planner tries: each stage whole nodes or a divisor of a node, one block at
    least per stage."""
    g = hw.gpus_per_node
    return [p for p in divisors(hw.world_size) if p <= num_layers
            and ((hw.world_size // p) % g == 0 or g % (hw.world_size // p) == 0)]


def check_pp(pp: int, num_layers: int, hw: Hardware) -> None:
    """One-line UserError unless ``pp`` stages can be placed on the cluster and run by the trainer."""
    if pp < 1:
        raise UserError(f"pp must be >= 1, got {pp}")
    if pp not in pipeline_sizes(hw, num_layers):
        raise UserError(f"pp={pp} does not split {hw.nodes} node(s) x {hw.gpus_per_node} GPUs into stages of whole "
                        f"nodes or of a divisor of a node, with a block per stage ({num_layers} blocks)")


def enumerate_layouts(num_heads: int, hw: Hardware, *, tp: Optional[int] = None, dp_shard: Optional[int] = None,
                      dp_replicate: Optional[int] = None, cp: Optional[int] = None, pp: Optional[int] = 1,
                      num_layers: Optional[int] = None) -> list[Layout]:
    """PP stages of whole nodes or a divisor of a node; TP | heads and TP | GPUs per node; CP | heads / TP;
    TP x CP x dp_shard inside a node; dp_replicate the rest of a stage (fixed ones kept; ``cp=None``
    / ``pp=None`` try every degree; ``num_layers`` bounds pp, one block per stage)."""
    if cp is not None:
        check_cp(cp, num_heads, hw, tp)
    layers = num_layers if num_layers is not None else hw.world_size
    if pp is not None:
        check_pp(pp, layers, hw)
    out = []
    for p in pipeline_sizes(hw, layers):
        if pp is not None and p != pp:
            continue
        stage = hw.world_size // p
        inner = min(stage, hw.gpus_per_node)
        for t in divisors(inner):
            if num_heads % t or (tp is not None and t != tp):
                continue
            for c in divisors(inner // t):
                if (num_heads // t) % c or (cp is not None and c != cp):
                    continue
                for s in divisors(inner // (t * c)):
                    r = stage // (t * c * s)
                    if (dp_shard is None or s == dp_shard) and (dp_replicate is None or r == dp_replicate):
                        out.append(Layout(t, s, r, c, p))
    if not out:
        raise UserError(f"no layout with pp={pp}, tp={tp}, cp={cp}, dp_shard={dp_shard}, dp_replicate="
                        f"{dp_replicate} on {hw.nodes} node(s) x {hw.gpus_per_node} GPUs ({num_heads} heads; "
                        f"TP x CP x dp_shard must divide the GPUs per node)")
    return out


def plan(work: Workload, hw: Hardware, *, tp: Optional[int] = None, dp_shard: Optional[int] = None,
         dp_replicate: Optional[int] = None, cp: Optional[int] = None, pp: Optional[int] = None,
         schedules: tuple[str, ...] = SCHEDULES) -> Plan:
    """Evaluate every candidate and choose the fastest that fits (or refuse, with the reason).

    ``cp=None`` / ``pp=None`` try every context- / pipeline-parallel degree, except under
    ``reward.async_scoring`` (which the trainer refuses with either): then only CP = PP = 1.
    """
    if work.async_scoring:
        for name, value in (("cp", cp), ("pp", pp)):
            if value is not None and value > 1:
                raise UserError(f"reward.async_scoring with parallel.{name}={value} is not supported by the "
                                f"trainer: set one of them off")
        cp, pp = 1, 1
    layouts = enumerate_layouts(work.arch.num_heads, hw, tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate,
                                cp=cp, pp=pp, num_layers=work.arch.num_layers)
    ac_options = (False, True) if work.activation_checkpointing is None else (work.activation_checkpointing,)
    cands = [estimate(variant, hw, lay, sched, ac) for lay in layouts for variant in _gather_variants(work, lay)
             for sched in schedules for ac in ac_options]
    order = {name: i for i, name in enumerate(("reweight", "retain", "native"))}
    modes = {name: i for i, name in enumerate(GATHER_MODES)}
    # Ties (within float noise) go to less memory, then Reweight, then the per-forward gathering.
    cands.sort(key=lambda c: (not c.feasible, not c.fits, round(c.step_time_s, 9) if c.feasible else 0.0,
                              c.peak_mem_bytes, order.get(c.schedule, 3), modes[c.gather_mode]))
    best = cands[0] if cands and cands[0].feasible and cands[0].fits else None
    if best is None:
        return Plan(None, refusal(cands, hw, work), None, cands, None, hw, work)
    placement = place(best.layout, hw, best.shape, work.group_size, work.prompts_per_step,
                      conventional=work.layout == "conventional")
    reason = explain(best, cands, work, hw, placement)
    if best.layout.cp > 1:
        reason += " " + cp_words(best, cands, work, hw)
    if best.layout.pp > 1:
        reason += " " + pp_words(best, cands, work, hw)
    if best.layout.pp > 1 or best.layout.cp > 1:
        reason += " " + run_words(best)
    if best.schedule == "reweight":
        reason += " " + reweight_words(work)
    return Plan(best.schedule, reason, best, cands, placement, hw, work)


def _gather_variants(work: Workload, lay: Layout) -> list[Workload]:
    """``work`` once per FSDP2 gathering mode to try on ``lay``: every mode for ``reshard_after_forward="auto"``
    with FSDP (without it nothing is gathered: the per-forward mode stands for all), else ``work`` as it is."""
    if work.reshard_after_forward != "auto":
        return [work]
    modes = GATHER_MODES if lay.fsdp else ("forward",)
    return [replace(work, reshard_after_forward=reshard_value(mode)) for mode in modes]


def _gpus_per_node(world_size: int, gpus_per_node: Optional[int]) -> int:
    if gpus_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        gpus_per_node = int(local) if local.isdigit() and int(local) > 0 else world_size
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise UserError(f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs")
    return gpus_per_node


def _fixed(value: Any) -> Optional[int]:
    return None if value == "auto" else int(value)


def config_schedules(config: Any) -> tuple[str, ...]:
    """The schedules a config leaves to the planner: all of them for ``schedule.name: auto``, else its own."""
    return SCHEDULES if config.schedule.name == "auto" else (config.schedule.name,)


def plan_for_config(config: Any, world_size: int, *, gpus_per_node: Optional[int] = None,
                    gpu_mem_gb: Optional[float] = None, require: bool = True, **hardware: Any) -> Plan:
    """Plan ``config`` on ``world_size`` ranks as the trainer resolves its ``auto`` keys; :class:`PlanError` when
    nothing fits (unless ``require`` is false: the refusal is then the plan's ``reason``).

    ``gpus_per_node`` defaults to ``$LOCAL_WORLD_SIZE`` (else one node); ``gpu_mem_gb`` None means unlimited
    memory (the plan then only compares time). The config's ``parallel.tp``, ``parallel.cp``, ``parallel.pp``,
    a named schedule and every key that is not ``auto`` (``dp_shard``, ``dp_replicate``,
    ``reshard_after_forward``, ``model.activation_checkpointing``) are kept; the ``auto`` ones are chosen. Extra
    keyword arguments set :class:`Hardware` fields (e.g. ``gpu_tflops``, ``inter_node_gbps``).
    """
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    g = _gpus_per_node(world_size, gpus_per_node)
    mem = None if gpu_mem_gb is None else int(gpu_mem_gb * GiB)
    hw = Hardware(nodes=world_size // g, gpus_per_node=g, gpu_mem_bytes=mem, **hardware)
    p = config.parallel
    result = plan(workload_from_config(config), hw, tp=p.tp, cp=p.cp, pp=p.pp, dp_shard=_fixed(p.dp_shard),
                  dp_replicate=_fixed(p.dp_replicate), schedules=config_schedules(config))
    return result.require() if require else result


def predict_memory(config: Any, *, world_size: int = 1, text_tokens: Optional[int] = None,
                   overhead_bytes: int = 0, decode_bytes: int = 0, device: str = "cuda",
                   stage: Optional[int] = None) -> dict[str, Estimate]:
    """Predicted memory of every schedule for ``config`` as written, on one node of ``world_size`` ranks.

    Degrees come from the config (``auto``: dp_replicate 1, dp_shard the rest after TP and CP). The default
    excludes the CUDA overhead, so the peak counts tensor bytes only, as a tensor-level meter sees them; each estimate's
    ``memory`` dict splits its peak phase into terms (weights, optimizer, activations, ...). ``decode_bytes`` is
    the transient memory of decoding one micro-batch (the VAE is an input of the planner; a built-in learned
    reward's model and scoring activations are derived from ``config.reward``). ``device="cpu"`` models torch's CPU optimizer (one parameter at a time).
    ``stage`` picks the pipeline stage whose memory is predicted (default: the heaviest).
    """
    p = config.parallel
    r = _fixed(p.dp_replicate) or 1
    s = _fixed(p.dp_shard) or world_size // (p.pp * p.tp * p.cp * r)
    if p.pp * p.tp * p.cp * s * r != world_size:
        raise UserError(f"pp {p.pp} x tp {p.tp} x cp {p.cp} x dp_shard {s} x dp_replicate {r} != world size "
                        f"{world_size}")
    layout = Layout(p.tp, s, r, p.cp, p.pp)
    hw = Hardware(nodes=1, gpus_per_node=world_size, overhead_bytes=overhead_bytes)
    work = workload_from_config(config, text_tokens=text_tokens, decode_bytes=decode_bytes)
    work = replace(work, foreach_optimizer=device != "cpu")
    ac = bool(work.activation_checkpointing)
    return {sched: estimate(work, hw, layout, sched, ac, stage) for sched in SCHEDULES}


def predict_peak_bytes(config: Any, *, world_size: int = 1, text_tokens: Optional[int] = None) -> dict[str, int]:
    """Predicted peak tensor bytes per rank of each schedule (``native``, ``retain``, ``reweight``)."""
    return {name: est.peak_mem_bytes for name, est in
            predict_memory(config, world_size=world_size, text_tokens=text_tokens).items()}
