"""The layout planner's words: a plan's choice explained against the other schedules, CP and PP, and refusals.

Pure Python, used by :func:`leangrpo_mcore.planner.layout.plan` for a plan's ``reason`` and by ``leangrpo-plan``.
"""

from __future__ import annotations

from leangrpo_mcore.planner.arch_specs import boundary_elements, stage_block_counts
from leangrpo_mcore.planner.cost_model import Estimate
from leangrpo_mcore.planner.pipeline_time import crossing_boundaries
from leangrpo_mcore.planner.placement import Placement
from leangrpo_mcore.planner.workload import SCHEDULES, GiB, Hardware, Workload

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


def cp_words(best: Estimate, cands: list[Estimate], work: Workload, hw: Hardware) -> str:
    """Why the chosen layout splits each sample over CP ranks (how to run it: :func:`run_words`)."""
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
    it: :func:`run_words`; the trainer's ``schedule.name=auto`` keeps the config's ``parallel.pp``)."""
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


def run_words(best: Estimate) -> str:
    """How to run a plan with stages or a CP split: the schedule named (``schedule.name=auto`` refuses
    ``parallel.cp > 1``), with the degrees."""
    lay = best.layout
    degrees = (f" parallel.pp={lay.pp}" if lay.pp > 1 else "") + (f" parallel.cp={lay.cp}" if lay.cp > 1 else "")
    refusal = " (schedule.name=auto refuses parallel.cp > 1)" if lay.cp > 1 else ""
    return f"Run it with schedule.name={best.schedule}{degrees}{refusal}."


def reweight_words(work: Workload) -> str:
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
    if lay.fsdp:
        parts.append(_GATHERING[est.gather_mode])
    parts.append("activation checkpointing" if est.activation_checkpointing else "no activation checkpointing")
    return ", ".join(parts)


_GATHERING = {"forward": "parameters gathered at every forward", "rollout": "parameters gathered once per rollout",
              "step": "parameters gathered once per step"}


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
