"""The layout planner: pick the schedule, PP / TP / CP / FSDP / HSDP degrees and the placement of prompt groups.

Pure Python (no torch.distributed). Candidates are every pipeline-parallel size whose stages are whole nodes or
divide a node (pp outermost, at most one stage per block), every TP size dividing both the attention heads and
the GPUs of a stage in a node, every CP (context-parallel) size dividing the heads per TP rank with TP x CP inside
a node (at every pp, as the trainer runs it), every FSDP shard degree filling part or all of the rest of a
node, HSDP replicas across the remaining GPUs of a stage, each schedule (Native, Retain, Reweight) and, unless
the experiment fixes it, activation checkpointing on and off.
:mod:`leangrpo_mcore.planner.cost_model` predicts each candidate's peak memory and step time; the fastest that
fits wins, and the plan explains the choice against the best of the other schedules (and, with CP > 1, against
CP = 1). When nothing fits the plan refuses, naming the smallest peak and what dominates it.

:func:`plan_for_config` is what the trainer calls for ``schedule.name: auto``; :func:`predict_memory` gives the
predicted peak of each schedule for a config as written (for comparing with a measured peak).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.config_workload import (  # noqa: F401 (the config entry points, re-exported)
    DEFAULT_TEXT_TOKENS,
    HASHED_TEXT_TOKENS,
    precision_from_config,
    workload_from_config,
)
from leangrpo_mcore.planner.arch_specs import boundary_elements, stage_block_counts
from leangrpo_mcore.planner.cost_model import Estimate, estimate
from leangrpo_mcore.planner.pipeline_time import crossing_boundaries
from leangrpo_mcore.planner.workload import SCHEDULES, GiB, Hardware, Layout, Workload
from leangrpo_mcore.planner.placement import Placement, place

_WORDS = {
    "rollout": "rollout forwards", "recompute": "recomputing the selected steps",
    "reference_forward": "reference forwards", "backward": "backward passes",
    "fsdp_all_gather": "FSDP all-gathers", "tp_all_reduce": "TP all-reduces",
    "cp_all_to_all": "context-parallel all-to-alls", "p2p": "stage-boundary sends",
    "pipeline_bubble": "the pipeline bubble",
    "grad_sync": "gradient synchronisation", "grad_buffers": "gradient-buffer traffic",
    "optimizer": "the optimizer", "reward": "rewards", "provisional_grads": "provisional gradients",
    "activations": "activations", "weights": "weights", "reward_model": "the reward model",
    "reward_activations": "the reward model's activations",
}


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``schedule``, ``reason``, ``candidates``, ``placement`` and the chosen layout."""
        chosen = None if self.chosen is None else candidate_dict(self.chosen)
        return {"schedule": self.schedule, "reason": self.reason, "chosen": chosen,
                "candidates": [candidate_dict(c) for c in self.candidates],
                "placement": None if self.placement is None else self.placement.to_dict(),
                "world_size": self.hardware.world_size, "gpu_mem_bytes": self.hardware.gpu_mem_bytes}


def candidate_dict(est: Estimate) -> dict[str, Any]:
    """One candidate as JSON: the documented JSON keys plus checkpointing, shape and notes."""
    shape = est.shape
    return {
        "schedule": est.schedule, "pp": est.layout.pp, "tp": est.layout.tp, "cp": est.layout.cp,
        "dp_shard": est.layout.dp_shard,
        "dp_replicate": est.layout.dp_replicate, "activation_checkpointing": est.activation_checkpointing,
        "generations_per_rank": shape.generations_per_rank if shape else None,
        "worker_groups": shape.worker_groups if shape else None,
        "peak_mem_bytes": est.peak_mem_bytes if est.feasible else None, "fits": est.fits,
        "feasible": est.feasible, "step_time_s": est.step_time_s if est.feasible else None,
        "max_selected_steps": est.max_selected_steps, "note": est.note, "details": dict(est.details),
        "breakdown": {"time_s": dict(est.time), "memory_bytes": dict(est.memory), "peak_phase": est.peak_phase},
    }


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
    cands = [estimate(work, hw, lay, sched, ac) for lay in layouts for sched in schedules for ac in ac_options]
    order = {name: i for i, name in enumerate(("reweight", "retain", "native"))}
    cands.sort(key=lambda c: (not c.feasible, not c.fits, c.step_time_s if c.feasible else 0.0,
                              c.peak_mem_bytes, order.get(c.schedule, 3)))
    best = cands[0] if cands and cands[0].feasible and cands[0].fits else None
    if best is None:
        return Plan(None, refusal(cands, hw, work), None, cands, None, hw, work)
    placement = place(best.layout, hw, best.shape, work.group_size, work.prompts_per_step,
                      conventional=work.layout == "conventional")
    reason = explain(best, cands, work, hw, placement)
    if best.layout.cp > 1:
        reason += " " + _cp_words(best, cands, work, hw)
    if best.layout.pp > 1:
        reason += " " + pp_words(best, cands, work, hw)
    if best.layout.pp > 1 or best.layout.cp > 1:
        reason += " " + _run_words(best)
    if best.schedule == "reweight":
        reason += " " + _reweight_words(work)
    return Plan(best.schedule, reason, best, cands, placement, hw, work)


def _cp_words(best: Estimate, cands: list[Estimate], work: Workload, hw: Hardware) -> str:
    """Why the chosen layout splits each sample over CP ranks (how to run it: :func:`_run_words`)."""
    c = best.layout.cp
    tokens = work.tokens[work.arch.blocks[0].stream]
    text = f"CP={c} splits each sample's {tokens} tokens over {c} GPUs"
    considered = [x for x in cands if x.layout.cp == 1]
    single = [x for x in considered if x.feasible]
    fits = [x for x in single if x.fits]
    if not considered:
        text += " (the degree asked for)."
    elif not single:
        text += f": no CP=1 layout is feasible ({considered[0].note})."
    elif not fits:
        low = min(single, key=lambda x: x.peak_mem_bytes)
        same = [x for x in single if (x.schedule, x.layout.tp, x.activation_checkpointing)
                == (best.schedule, best.layout.tp, best.activation_checkpointing)]
        text += (f": nothing fits at CP=1 (smallest peak {_gib(low.peak_mem_bytes)} of {_gib(hw.gpu_mem_bytes)}: "
                 f"{low.schedule.capitalize()} with {describe_layout(low, work)}; largest terms: {_top(low.memory)})")
        if same:
            text += (f"; one sample's activations per trained step are "
                     f"{_gib(same[0].details['activations_per_sample_bytes'])} at CP=1 and "
                     f"{_gib(best.details['activations_per_sample_bytes'])} here")
        text += "."
    else:
        other = min(fits, key=lambda x: x.step_time_s)
        diff = {k: other.time.get(k, 0.0) - best.time.get(k, 0.0) for k in other.time}
        worst = max(diff, key=diff.get)
        words = _WORDS.get(worst, worst)
        if worst == "backward" and other.activation_checkpointing and not best.activation_checkpointing:
            words = "recomputing activations in backward (at CP=1 it needs activation checkpointing to fit)"
        text += (f": the fastest at CP=1 ({other.schedule.capitalize()} with {describe_layout(other, work)}) takes "
                 f"{other.step_time_s:.1f} s/step, mostly {words} (+{diff[worst]:.1f} s).")
    return text


def pp_words(best: Estimate, cands: list[Estimate], work: Workload, hw: Hardware) -> str:
    """Why the chosen layout splits the blocks into pipeline stages, against the best layout without (how to run
    it: :func:`_run_words`; the trainer's ``schedule.name=auto`` keeps the config's ``parallel.pp``)."""
    lay = best.layout
    counts = stage_block_counts(work.arch.num_layers, lay.pp)
    per_node = lay.stage_ranks / hw.gpus_per_node
    where = ("one stage per node" if per_node == 1 else f"one stage per {int(per_node)} nodes" if per_node > 1
             else f"{round(1 / per_node)} stages per node")
    sample = boundary_elements(work.arch, work.tokens) * work.precision.compute_bytes * (2 if work.cfg else 1)
    across = sum(crossing_boundaries(hw, lay))
    link = (f", {across} of the {lay.pp - 1} boundaries over the {hw.inter_node_gbps:g} GB/s links between "
            f"nodes") if across else ""
    text = (f"PP={lay.pp} splits the {work.arch.num_layers} blocks {'/'.join(map(str, counts))} over {lay.pp} "
            f"stages, {where}: each GPU holds only its stage's parameters, gradients and optimizer state, and "
            f"{sample / 1e6:.1f} MB per sample crosses a stage boundary each forward{link}; the pipeline bubble "
            f"costs {best.time['pipeline_bubble']:.1f} s/step and the boundary sends {best.time['p2p']:.1f} s/step")
    considered = [x for x in cands if x.layout.pp == 1 and x.feasible]
    fits = [x for x in considered if x.fits]
    if not considered:
        text += " (the degree asked for)."
    elif not fits:
        low = min(considered, key=lambda x: x.peak_mem_bytes)
        text += (f". Nothing fits at PP=1 (smallest peak {_gib(low.peak_mem_bytes)} of {_gib(hw.gpu_mem_bytes)}: "
                 f"{low.schedule.capitalize()} with {describe_layout(low, work)}; largest terms: {_top(low.memory)}).")
    else:
        other = min(fits, key=lambda x: x.step_time_s)
        diff = {k: other.time.get(k, 0.0) - best.time.get(k, 0.0) for k in other.time}
        worst = max(diff, key=diff.get)
        text += (f". The fastest at PP=1 ({other.schedule.capitalize()} with {describe_layout(other, work)}) takes "
                 f"{other.step_time_s:.1f} s/step, mostly {_WORDS.get(worst, worst)} (+{diff[worst]:.1f} s).")
    return text


def _run_words(best: Estimate) -> str:
    """How to run a plan with stages or a CP split: the schedule named (``schedule.name=auto`` refuses
    ``parallel.cp > 1``), with the degrees."""
    lay = best.layout
    degrees = (f" parallel.pp={lay.pp}" if lay.pp > 1 else "") + (f" parallel.cp={lay.cp}" if lay.cp > 1 else "")
    refusal = " (schedule.name=auto refuses parallel.cp > 1)" if lay.cp > 1 else ""
    return f"Run it with schedule.name={best.schedule}{degrees}{refusal}."


def _reweight_words(work: Workload) -> str:
    """How the chosen Reweight accumulates, and why it fell back if it did (one sentence)."""
    text = f"Reweight accumulates {work.reweight_accumulate.replace('_', '-')} provisional gradients"
    if work.global_std:
        text += (", folding each group and scaling once by the global std" if work.reweight_global_fold else
                 ", keeping every local one until the step's last reward (global std)")
    return text + (f"; {work.reweight_note}." if work.reweight_note else ".")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def describe_layout(est: Estimate, work: Workload) -> str:
    """Words for a candidate's layout: degrees, group sharing and checkpointing."""
    lay, shape = est.layout, est.shape
    parts = [f"PP={lay.pp}"] if lay.pp > 1 else []
    parts.append(f"TP={lay.tp}")
    if lay.cp > 1:
        parts += [f"CP={lay.cp}", f"FSDP over {lay.shard_ranks} (dp_shard {lay.dp_shard} x CP {lay.cp})"]
    else:
        parts.append(f"FSDP over {lay.dp_shard}")
    if lay.dp_replicate > 1:
        parts.append(f"{lay.dp_replicate} HSDP replicas")
    if shape is not None and work.layout == "shared":
        if shape.worker_groups > 1:
            parts.append(f"{shape.worker_groups} worker groups of {shape.ranks_per_group}")
        else:
            parts.append(f"{shape.generations_per_rank} generation(s) per rank")
    parts.append("activation checkpointing" if est.activation_checkpointing else "no activation checkpointing")
    return ", ".join(parts)


def _top(terms: dict, n: int = 2) -> str:
    items = sorted(((v, k) for k, v in terms.items() if v > 0), reverse=True)[:n]
    return ", ".join(f"{_WORDS.get(k, k.replace('_', ' '))} {_gib(v)}" for v, k in items)


def _versus(other: Estimate, best: Estimate, work: Workload) -> str:
    name = other.schedule.capitalize() + (f" (PP={other.layout.pp})" if other.layout.pp > 1 else "")
    if not other.fits:
        text = f"{name} does not fit (best {_gib(other.peak_mem_bytes)} in {other.peak_phase}: {_top(other.memory)})"
        if other.schedule == "retain" and other.max_selected_steps is not None:
            text += f"; it runs out of memory at selected step {other.max_selected_steps + 1}"
        return text
    ratio = other.step_time_s / best.step_time_s if best.step_time_s else 1.0
    if ratio < 1.005:
        return f"{name} is as fast within 0.5% ({other.step_time_s:.1f} s/step)"
    diff = {k: other.time.get(k, 0.0) - best.time.get(k, 0.0) for k in other.time}
    worst = max(diff, key=diff.get)
    words = _WORDS.get(worst, worst)
    if worst == "backward" and other.activation_checkpointing and not best.activation_checkpointing:
        words = "recomputing activations in backward (it needs activation checkpointing to fit)"
    return f"{name} is {ratio:.2f}x slower at best ({other.step_time_s:.1f} s/step, mostly {words}, " \
           f"+{diff[worst]:.1f} s)"


def explain(best: Estimate, cands: list[Estimate], work: Workload, hw: Hardware, placement: Placement) -> str:
    """The choice in words, with the best candidate of each other schedule for comparison."""
    mem = "unlimited memory" if hw.gpu_mem_bytes is None else f"{_gib(hw.gpu_mem_bytes)} per GPU"
    fitting = sum(1 for c in cands if c.fits and c.feasible)
    text = [f"{best.schedule.capitalize()} with {describe_layout(best, work)}: {best.step_time_s:.1f} s/step, "
            f"peak {_gib(best.peak_mem_bytes)} of {mem}; fastest of {fitting} fitting candidates."]
    if best.schedule == "reweight":
        text.append(f"It keeps {_gib(best.details['provisional_grad_bytes'])} of unsharded provisional gradients "
                    f"per GPU.")
    for sched in SCHEDULES:
        if sched == best.schedule:
            continue
        pool = [c for c in cands if c.schedule == sched and c.feasible]
        fits = [c for c in pool if c.fits]
        if pool:
            other = min(fits, key=lambda c: c.step_time_s) if fits else min(pool, key=lambda c: c.peak_mem_bytes)
            text.append(_versus(other, best, work) + ".")
    if not placement.group_gather_intra_node:
        text.append(f"Each prompt group's reward all-gather spans {placement.group_gather_nodes} nodes "
                    f"(group size x TP exceeds a node).")
    return " ".join(text)


def refusal(cands: list[Estimate], hw: Hardware, work: Workload) -> str:
    """Why nothing fits: the smallest peak and its largest terms, or why no layout is feasible."""
    feasible = [c for c in cands if c.feasible]
    if not feasible:
        return f"no parallel layout can split the work: {cands[0].note}" if cands else "no candidate layout"
    low = min(feasible, key=lambda c: c.peak_mem_bytes)
    return (f"nothing fits in {_gib(hw.gpu_mem_bytes)} per GPU: the smallest predicted peak is "
            f"{_gib(low.peak_mem_bytes)} ({low.schedule}, {describe_layout(low, work)}; largest terms: "
            f"{_top(low.memory, 3)}); use LoRA, more or larger GPUs, activation checkpointing, fewer "
            f"generations per rank or a smaller micro-batch / resolution")


def _gpus_per_node(world_size: int, gpus_per_node: Optional[int]) -> int:
    if gpus_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        gpus_per_node = int(local) if local.isdigit() and int(local) > 0 else world_size
    if gpus_per_node < 1 or world_size % gpus_per_node:
        raise UserError(f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs")
    return gpus_per_node


def _fixed(value: Any) -> Optional[int]:
    return None if value == "auto" else int(value)


def plan_for_config(config: Any, world_size: int, *, gpus_per_node: Optional[int] = None,
                    gpu_mem_gb: Optional[float] = None, **hardware: Any) -> Plan:
    """Plan ``config`` on ``world_size`` ranks (``schedule.name: auto``); :class:`PlanError` when nothing fits.

    ``gpus_per_node`` defaults to ``$LOCAL_WORLD_SIZE`` (else one node); ``gpu_mem_gb`` None means unlimited
    memory (the plan then only compares time). The config's ``parallel.tp``, ``parallel.cp``, ``parallel.pp``, activation
    checkpointing and any integer ``dp_shard`` / ``dp_replicate`` are kept; ``auto`` degrees are chosen. Extra
    keyword arguments set :class:`Hardware` fields (e.g. ``gpu_tflops``, ``inter_node_gbps``).
    """
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    g = _gpus_per_node(world_size, gpus_per_node)
    mem = None if gpu_mem_gb is None else int(gpu_mem_gb * GiB)
    hw = Hardware(nodes=world_size // g, gpus_per_node=g, gpu_mem_bytes=mem, **hardware)
    p = config.parallel
    result = plan(workload_from_config(config), hw, tp=p.tp, cp=p.cp, pp=p.pp, dp_shard=_fixed(p.dp_shard),
                  dp_replicate=_fixed(p.dp_replicate))
    return result.require()


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
