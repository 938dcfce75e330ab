"""Memory and time model of one optimizer step per rank, for each schedule and parallel layout (pure Python).

Memory (bytes per GPU) is the maximum over the phases of a step (rollout, the schedule's update, gradient sync,
optimizer step) of the tensors alive in that phase: sharded weights / gradients / optimizer state (FSDP2 divides
them by ``dp_shard x cp``, TP by ``tp`` for the head-parallel layers), the gathered working parameters,
activations from the calibrated fit (:mod:`leangrpo_mcore.planner.activations`), Reweight's unsharded
provisional gradients, the rollout's working set and trajectory store, fixed reservations (CUDA/NCCL overhead,
``--reward-mem-gb``) and, on the scoring ranks only (CP rank 0 of the last pipeline stage), the learned reward
model and its scoring activations (:mod:`leangrpo_mcore.planner.reward_specs`). Context parallelism (``cp``)
splits every sample's tokens, so the per-token terms (activations, working sets, Retain's graphs, trajectory
latents) are divided by ``cp``; the unsharded gradients are not (each CP rank holds a full-size partial one).

Time (seconds per optimizer step) adds compute (FLOPs over the GPU rate times an efficiency, divided by ``cp``),
FSDP all-gathers, TP all-reduces, CP all-to-alls, gradient reduce-scatters (+ HSDP all-reduce across replicas),
Reweight's gradient-buffer traffic, the optimizer and the reward. Communication is counted as exposed (not
overlapped): a pessimistic model that ranks layouts the way the paper's measurements do (per-backward syncs are
what coalescing removes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner import activations as act
from leangrpo_mcore.planner import pipeline_time as pt
from leangrpo_mcore.planner.arch_specs import (
    DEFAULT_LORA_TARGETS,
    ArchSpec,
    boundary_elements,
    forward_flops,
    largest_block_params,
    lora_params_per_rank,
    params_per_rank,
    self_attention_exchange_elements,
    stage_spec,
    stored_params_per_rank,
    tp_allreduce_elements,
)
from leangrpo_mcore.planner.gather_cost import full_gathers, gather_seconds, gathered_elements, mode_of, refused_mode
from leangrpo_mcore.planner.passes import coalesced, reweight_parts, step_passes, sync_count
from leangrpo_mcore.planner.workload import SCHEDULES, Hardware, Layout, Shape, Workload, sample_shape


def max_selected_that_fit(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool) -> int:
    """The most selected steps ``schedule`` fits in memory (all of them when memory is unlimited)."""
    if hw.gpu_mem_bytes is None:
        return work.selected_steps
    best = 0
    for steps in range(1, work.selected_steps + 1):
        trial = replace(work, selected_steps=steps)
        if peak_memory(trial, hw, layout, schedule, ac)[0] > hw.gpu_mem_bytes:
            break
        best = steps
    return best


def _reweight_buffers(work: Workload, shape: Shape) -> int:
    """Unsharded gradient buffers Reweight keeps at once (see ``schedules/reweight.py``)."""
    q, b = shape.generations_per_rank, shape.micro_batch
    live = min(q, b + 2) if work.reweight_accumulate == "affine" else q
    if work.global_std and not work.reweight_global_fold:
        # The global std needs the step's last reward: every local provisional gradient of the step waits.
        live = q * shape.groups_per_rank
    elif work.global_std:
        live += 1  # the folded sum of the earlier groups
    return live + (1 if work.kl_beta > 0 else 0)  # KL: a separate unscaled accumulator


def _memory_terms(work: Workload, hw: Hardware, layout: Layout, ac: bool, stage: int = 0,
                  mode: str = "forward") -> dict[str, int]:
    """Every memory term (bytes per GPU of pipeline stage ``stage``) the phases combine, and the counts that
    scale them. A stage holds its own layers' parameters, gradients, optimizer state and activations, and the
    whole trajectory (every stage takes the same SDE steps). ``mode`` is the FSDP2 gathering mode
    (:mod:`leangrpo_mcore.planner.gather_cost`)."""
    prec, s, shape = work.precision, layout.shard_ranks, sample_shape(work, layout)
    arch = stage_spec(work.arch, layout.pp, stage)
    cp = layout.cp
    params = stored_params_per_rank(arch, layout.tp)
    trainable = _trainable_per_rank(work, arch, layout.tp)
    # a LoRA base and a frozen expert (its adapters too) are kept in the compute dtype (engine/build.py)
    frozen = params - (trainable if work.full_finetune else 0) + (
        0 if work.full_finetune else trainable // work.trained_experts * (arch.experts - work.trained_experts))
    opt_bytes = {"adamw": 2 * prec.storage_bytes, "sgd": prec.storage_bytes if work.momentum else 0}[work.optimizer]
    gathered_rollout, gathered_update = gathered_elements(arch, layout, mode)
    # FSDP2 stages one block's unsharded gradient before reducing it; without FSDP (no rank outside TP) the
    # forward uses the stored parameters and backward writes straight into their gradients.
    block_grad = largest_block_params(arch, layout.tp) * prec.buffer_bytes if layout.fsdp else 0
    cfg = 2 if work.cfg else 1
    batch = shape.micro_batch * cfg
    dtype = 2 if prec.compute_bytes <= 2 else 4
    # CP: a rank holds 1/cp of every sample's tokens, so its activations and working sets are 1/cp of the fit's.
    fit = {"tp": layout.tp, "lora_rank": _fitted_lora_rank(work)}
    per_sample_step = -(-act.saved_bytes(arch, work.tokens, batch=cfg, dtype_bytes=dtype, checkpointing=ac,
                                         **fit) // cp)
    working = -(-act.working_bytes(arch, work.tokens, batch=batch, dtype_bytes=prec.compute_bytes) // cp)
    recompute = -(-act.block_saved_bytes(arch, work.tokens, batch=batch, dtype_bytes=dtype, **fit) // cp) if ac else 0
    text_width = next(lin.in_features for lin in work.arch.root if lin.stream == "text")
    # A trajectory keeps fp32 latents for every step (docs/algorithms.md §7), each CP rank its piece
    # (parallel/sequence.py), and the prompt's text embeddings.
    per_step = work.num_steps + 1 + (work.num_steps if work.keep_means else 0)  # + GRPO-Guard's kept means
    trajectory = -(-4 * per_step * work.arch.latent_elements(work.tokens) * cfg // cp)
    trajectory += 4 * work.arch.reference_elements(work.tokens)  # a float32 conditioning image, whole on every CP rank
    trajectory += work.tokens["text"] * text_width * prec.compute_bytes
    # Only CP rank 0 of the last stage scores (engine/step/reward_join.py): it alone holds the reward model. The
    # planner's rank of a stage stands for its heaviest one, so the last stage's is that scoring rank.
    scores = stage == layout.pp - 1
    # A no-grad pipelined rollout keeps no boundary after sending it (parallel/stages.py): a stage before the last
    # holds at most two micro-batches' boundaries at once (the one it sends, the next it makes), whatever their count.
    boundaries = 0 if scores else -(-2 * boundary_elements(work.arch, work.tokens) * prec.compute_bytes * batch // cp)
    return {
        "weights": math.ceil((trainable * prec.storage_bytes + frozen * prec.compute_bytes) / s),
        "optimizer_temporaries": math.ceil((trainable if work.foreach_optimizer else _largest_weight(arch))
                                           * prec.storage_bytes / s),
        "optimizer": math.ceil(trainable * opt_bytes / s),
        "grads": math.ceil(trainable * prec.grad_bytes / s),
        "gathered_rollout": gathered_rollout * prec.compute_bytes,
        "gathered_update": gathered_update * prec.compute_bytes,
        "reference": math.ceil(trainable * prec.compute_bytes / s) if work.kl_beta > 0 and work.full_finetune else 0,
        "reserved": hw.overhead_bytes + work.reward_mem_bytes,
        "reward_model": work.reward_model_bytes if scores else 0,
        "reward_activations": work.reward_activation_bytes if scores else 0,
        "activations_step": per_sample_step * shape.micro_batch,
        "activations_sample_step": per_sample_step,
        "backward_transient": recompute + working + block_grad,
        "rollout_working": working,
        "rollout_boundaries": boundaries,
        "decode": work.decode_bytes,
        "trajectory": trajectory,
        "gradient_buffer": trainable * prec.buffer_bytes,
        "buffers": _reweight_buffers(work, shape),
        "samples": shape.samples,
        "generations_per_rank": shape.generations_per_rank,
        "groups_per_rank": shape.groups_per_rank,
        # Native's 1F1B recompute at pp > 1: stage k holds the graphs of up to pp - k units (micro-batch, step)
        "in_flight": min(layout.pp - stage, shape.micro_batches // shape.groups_per_rank * work.selected_steps),
        # Reweight's 1F1B over a denoising step's trained samples (two units each with the KL term at pp > 1):
        # stage k holds up to pp - k one-sample graphs (one at pp = 1)
        "in_flight_samples": min(layout.pp - stage, shape.generations_per_rank * reweight_parts(work, layout.pp)),
    }


def _trainable_per_rank(work: Workload, arch: ArchSpec, tp: int) -> int:
    """Trainable parameters a TP rank holds before FSDP sharding: the trained experts' weights, or their adapters."""
    per_expert = params_per_rank(arch, tp) if work.full_finetune else lora_params_per_rank(
        arch, work.lora_rank, work.lora_targets, tp)
    return per_expert * work.trained_experts


def _fitted_lora_rank(work: Workload) -> int:
    """The LoRA rank the activation fit is evaluated at: 0 (full fine-tuning's fit) unless the adapters sit on the
    default targets the LoRA fit was measured with; other targets are charged as full fine-tuning, which saves
    the input of every linear (an upper bound up to the adapters' own small activations)."""
    if work.full_finetune or tuple(work.lora_targets) != DEFAULT_LORA_TARGETS[work.arch.family]:
        return 0
    return work.lora_rank


def _largest_weight(arch) -> int:
    """Elements of the largest single weight matrix (bounds a one-parameter-at-a-time optimizer's temporaries)."""
    return max(lin.in_features * lin.out_features for lin in arch.root + sum((b.held for b in arch.blocks), ()))


def memory_phases(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool,
                  stage: int = 0) -> dict[str, dict]:
    """Bytes per GPU (of pipeline stage ``stage``) of each term alive in each phase of a step under ``schedule``.

    Follows the project's schedules: Native syncs per backward (sharded gradients only) unless coalesced;
    Retain and coalesced Native accumulate one unsharded gradient with FSDP2 sync off and reduce it once per
    update; Reweight keeps one provisional gradient per in-flight sample (+1 KL accumulator) and reduces
    each group's scaled sum into the sharded gradients.
    """
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r} (expected one of {', '.join(SCHEDULES)})")
    m = _memory_terms(work, hw, layout, ac, stage, mode_of(work, layout, schedule))
    # The phases inside a rollout (its forwards, Reweight's provisional gradients, Retain's graphs, scoring)
    # hold the rollout's gathered parameters; the update's phases the update's.
    update = {k: m[k] for k in ("weights", "optimizer", "reference", "reserved", "reward_model")}
    base = {**update, "gathered_params": m["gathered_rollout"]}
    update["gathered_params"] = m["gathered_update"]
    unsharded = m["gradient_buffer"] if coalesced(work, schedule) else 0
    sharded = 0 if coalesced(work, schedule) else m["grads"]
    trajectories = m["trajectory"] * (m["samples"] if schedule == "native" else 1)
    phases = {
        "rollout": {**base, "trajectories": trajectories, "rollout_working": m["rollout_working"],
                    "rollout_boundaries": m["rollout_boundaries"]},
        "optimizer_step": {"weights": m["weights"], "optimizer": m["optimizer"], "grads": m["grads"],
                           "reserved": m["reserved"], "reward_model": m["reward_model"],
                           "optimizer_temporaries": m["optimizer_temporaries"]},
    }
    if coalesced(work, schedule) or work.updates_per_rollout > 1:
        # Reducing the unsharded gradient into the sharded one holds both; one data-parallel rank just moves it.
        staged = m["gradient_buffer"] if layout.fsdp else 0
        phases["gradient_sync"] = {**update, "grads": m["grads"], "unsharded_grads": staged}
    if schedule == "native" or work.updates_per_rollout > 1:
        phases["native_update"] = {
            **update, "grads": sharded, "unsharded_grads": unsharded, "trajectories": m["trajectory"] * m["samples"],
            "activations": m["activations_step"] * m["in_flight"], "backward_transient": m["backward_transient"]}
    # Retain's graphs: |S| per generation of a group; with the global std the advantages wait for the step's
    # last reward, so every group's graphs are kept.
    graphs = work.selected_steps * m["generations_per_rank"] * (m["groups_per_rank"] if work.global_std else 1)
    if schedule == "retain":
        phases["retain_graphs"] = {
            **base, "unsharded_grads": unsharded, "trajectories": trajectories,
            "activations": m["activations_sample_step"] * graphs,
            "backward_transient": max(m["backward_transient"], m["rollout_working"])}
    if schedule == "reweight":
        earlier = m["grads"] if m["groups_per_rank"] > 1 else 0  # sharded sums of the step's earlier groups
        phases["provisional_gradients"] = {
            **base, "grads": earlier, "trajectories": trajectories,
            "provisional_grads": m["gradient_buffer"] * m["buffers"],
            # each trained sample's forward runs alone and is backpropagated at once: one sample's graph (pp - k of
            # them on stage k of a 1F1B schedule)
            "activations": m["activations_sample_step"] * m["in_flight_samples"],
            "backward_transient": m["backward_transient"]}
    phases["reward"] = _reward_phase(m, base, schedule, graphs, trajectories, unsharded)
    return phases


def _reward_phase(m: dict, base: dict, schedule: str, graphs: int, trajectories: int, unsharded: int) -> dict:
    """Decoding and scoring a micro-batch while the schedule still holds its trajectories, graphs or buffers."""
    later_group = m["groups_per_rank"] > 1  # buffers of the step's earlier groups already exist
    held = {"native": {},
            "retain": {"activations": m["activations_sample_step"] * graphs,
                       "unsharded_grads": unsharded if later_group else 0},
            "reweight": {"provisional_grads": m["gradient_buffer"] * m["buffers"],
                         "grads": m["grads"] if later_group else 0}}[schedule]
    return {**base, **held, "trajectories": trajectories, "decode": m["decode"],
            "reward_activations": m["reward_activations"]}


def heaviest_stage(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool) -> tuple[int, dict]:
    """(the pipeline stage with the highest peak, its phases); stage 0 and the whole model at pp = 1."""
    best, best_phases, best_peak = 0, {}, -1
    for stage in range(layout.pp):
        phases = memory_phases(work, hw, layout, schedule, ac, stage)
        peak = max(sum(terms.values()) for terms in phases.values())
        if peak > best_peak:
            best, best_phases, best_peak = stage, phases, peak
    return best, best_phases


def peak_memory(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool) -> tuple[int, str, dict]:
    """(peak bytes per GPU, the phase where it occurs, that phase's terms), on the heaviest pipeline stage."""
    _, phases = heaviest_stage(work, hw, layout, schedule, ac)
    name = max(phases, key=lambda p: sum(phases[p].values()))
    return sum(phases[name].values()), name, phases[name]


@dataclass(frozen=True)
class _Rates:
    forward: float
    backward: float
    tp_per_pass: float
    cp_forward: float
    cp_backward: float


def _rates(work: Workload, hw: Hardware, layout: Layout, ac: bool, arch: Optional[ArchSpec] = None) -> _Rates:
    """Seconds of one forward and one backward of one sample (CFG included) on one rank of ``arch`` (a pipeline
    stage; default the whole model), and of its TP all-reduces and CP all-to-alls (a rank holds 1/cp of the
    sample's tokens)."""
    arch = work.arch if arch is None else arch
    flops = forward_flops(arch, work.tokens, layout.tp)
    cfg, cp, tp = (2 if work.cfg else 1), layout.cp, layout.tp
    rate = hw.gpu_tflops * 1e12 * hw.efficiency
    linear = cfg * flops["linear"] / (rate * work.precision.matmul_speedup) / cp
    attention = cfg * flops["attention"] / rate / cp
    # Backward: input gradients (1x) + weight gradients (1x, frozen LoRA bases skip theirs); attention 2x.
    backward = (2.0 if work.full_finetune else 1.0) * linear + 2.0 * attention + (linear + attention if ac else 0.0)
    elems = tp_allreduce_elements(arch, work.tokens) * cfg / cp
    tp_bytes = 2.0 * (tp - 1) / tp * elems * work.precision.compute_bytes
    # Ulysses: q, k, v out and the output back, (cp - 1)/cp of the rank's S/cp x H/tp x D each, per
    # self-attention layer; backward the same (+ the recomputed forward's under checkpointing).
    exchanged = self_attention_exchange_elements(arch, work.tokens) * cfg / (cp * tp)
    cp_forward = (cp - 1) / cp * exchanged * work.precision.compute_bytes / (hw.intra_node_gbps * 1e9)
    return _Rates(linear + attention, backward, tp_bytes / (hw.intra_node_gbps * 1e9), cp_forward,
                  cp_forward * (2.0 if ac else 1.0))


def _sync_seconds(work: Workload, hw: Hardware, layout: Layout, trainable: int, arch: ArchSpec) -> float:
    """One gradient synchronisation: reduce-scatter in the node, all-reduce of the shard across replicas (each a
    collective per FSDP unit)."""
    payload = trainable * work.precision.buffer_bytes
    s, r = layout.shard_ranks, layout.dp_replicate
    units = (sum(block.count for block in arch.blocks) + 1) * work.trained_experts
    seconds = (s - 1) / s * payload / (hw.reduce_scatter_rate * 1e9) + (units * hw.collective_latency_s if s > 1
                                                                      else 0.0)
    replica_bw = hw.inter_node_gbps if layout.stage_ranks > hw.gpus_per_node else hw.intra_node_gbps
    if r > 1:
        seconds += units * hw.collective_latency_s
    return seconds + 2.0 * (r - 1) / r * payload / s / (replica_bw * 1e9)


# The terms of a step that are the policy's own forwards and backwards (what pipeline stages wait on each other for).
COMPUTE_TERMS = ("rollout", "recompute", "reference_forward", "backward", "tp_all_reduce", "cp_all_to_all")


def step_time(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool) -> dict[str, float]:
    """Seconds per optimizer step by component (the sum is the step time).

    At ``pp`` > 1 the terms are those of the slowest stage (its own layers' compute and communication) plus
    ``p2p`` (stage-boundary transfers) and ``pipeline_bubble`` (waiting for the other stages), from the
    makespans of :mod:`leangrpo_mcore.planner.pipeline_time`.
    """
    if layout.pp == 1:
        return {**_stage_time(work, hw, layout, schedule, ac, work.arch), "p2p": 0.0, "pipeline_bubble": 0.0}
    stages = [stage_spec(work.arch, layout.pp, k) for k in range(layout.pp)]
    times = [_stage_time(work, hw, layout, schedule, ac, arch) for arch in stages]
    own = max(times, key=lambda t: sum(t.values()))
    compute = [sum(t[k] for k in COMPUTE_TERMS) for t in times]
    span, p2p = _pipeline_span(work, hw, layout, schedule, ac, stages, compute)
    return {**own, "p2p": p2p, "pipeline_bubble": max(span - p2p - sum(own[k] for k in COMPUTE_TERMS), 0.0)}


def _pipeline_span(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool,
                   stages: list[ArchSpec], compute: list[float]) -> tuple[float, float]:
    """(seconds from the first stage's first forward to the last backward, boundary seconds within them).

    Native: each denoising step's forwards of a group's micro-batches are one forward-only schedule (the SDE
    step needs the velocities before the next), the KL reference forwards one forward-only schedule over the
    units (``schedules/native.py``), and each update's recompute is one 1F1B schedule over the
    (micro-batch, selected step) units. Retain: the rollout's steps as Native's (the trained ones keep their
    graphs), the KL reference forwards as Native's, its deferred backward a backward pipeline over the kept graphs
    (the forward-only makespan with the backward's seconds). Reweight: an untrained step as Native's; a trained step
    one 1F1B schedule over the group's samples on the rank, each forward alone and backpropagated at once (with the
    KL term two units per sample, after a forward-only schedule of the reference forwards). The groups of the later
    update blocks are Native's; a rollout is T' steps.
    """
    shape = sample_shape(work, layout)
    rates = [_rates(work, hw, layout, ac, arch) for arch in stages]
    b, cfg = shape.micro_batch, (2 if work.cfg else 1)
    groups, per_group = shape.groups_per_rank, shape.micro_batches // shape.groups_per_rank
    # each CP rank sends its tokens of the boundary to the same CP rank of the next stage
    sample_bytes = cfg * boundary_elements(work.arch, work.tokens) * work.precision.compute_bytes / layout.cp
    hops = pt.boundary_seconds(hw, layout, b * sample_bytes)
    # the float32 velocity the last stage broadcasts to the others after each micro-batch's forward
    velocity = max(pt.boundary_seconds(hw, layout, b * cfg * 4 * work.arch.latent_elements(work.tokens)))
    fwd = [b * (r.forward + r.tp_per_pass) for r in rates]
    bwd = [b * (r.backward + r.tp_per_pass) for r in rates]
    units = per_group * work.selected_steps
    roll = pt.forward_only(fwd, hops, per_group)
    ref = (0.0, 0.0)
    if work.kl_beta > 0:  # the KL reference forwards: one forward-only call over the units, before the backward
        ref = pt.forward_only(fwd, hops, units)
        ref = (ref[0] + units * velocity, ref[1] + units * velocity)
    train = pt.one_f_one_b(fwd, bwd, hops, units)
    rollout_steps, steps = work.forwards_per_rollout, work.selected_steps
    step_roll = [part + per_group * velocity for part in roll]

    def group(name: str) -> list[float]:
        """(makespan, boundary seconds) of one group's rollout and update under schedule ``name``."""
        if name == "reweight":
            trained = _reweight_trained_step(work, rates, pt.boundary_seconds(hw, layout, sample_bytes),
                                             velocity / b, per_group * b, layout.pp)
            return [(rollout_steps - steps) * r + steps * t for r, t in zip(step_roll, trained)]
        first = pt.forward_only(bwd, hops, units) if name == "retain" else train
        return [rollout_steps * r + k + f for r, k, f in zip(step_roll, ref, first)]

    # the first block's groups trained by the schedule, the later blocks' by Native
    own, native, share = group(schedule), group("native"), work.first_block
    span, p2p = (groups * (share * o + (1 - share) * n) for o, n in zip(own, native))
    return span, p2p


def _reweight_trained_step(work: Workload, rates: list[_Rates], hops: list[float], velocity: float, samples: int,
                           pp: int) -> tuple[float, float]:
    """(makespan, boundary seconds) of one trained denoising step of a group under Reweight at ``pp`` > 1: its
    ``samples`` forwards of one sample, each backpropagated at once, as one 1F1B schedule (two units a sample with
    the KL term, after a forward-only schedule of the reference forwards), each velocity broadcast after."""
    fwd = [r.forward + r.tp_per_pass for r in rates]
    bwd = [r.backward + r.tp_per_pass for r in rates]
    span, p2p = pt.one_f_one_b(fwd, bwd, hops, samples * reweight_parts(work, pp))
    if work.kl_beta > 0:
        ref = pt.forward_only(fwd, hops, samples)
        span, p2p = span + ref[0] + samples * velocity, p2p + ref[1] + samples * velocity
    return span + samples * velocity, p2p + samples * velocity


def _stage_time(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool,
                arch: ArchSpec) -> dict[str, float]:
    """Seconds per optimizer step by component of a rank holding ``arch`` (the whole model or one stage)."""
    shape = sample_shape(work, layout)
    rates, n, mb = _rates(work, hw, layout, ac, arch), shape.samples, shape.micro_batches
    steps, rollout = work.selected_steps, work.forwards_per_rollout
    kl = work.kl_beta > 0
    trainable = _trainable_per_rank(work, arch, layout.tp)
    forwards, backwards = step_passes(work, schedule, layout.pp)
    # Reweight runs each trained sample's forward and backward alone (batch 1) whatever the micro-batch B: B
    # per-sample forwards and backwards, the work charged per sample below (no B backwards of a batched graph).
    shards = layout.shard_ranks
    gathers = full_gathers(work, shape, schedule, mode_of(work, layout, schedule), layout.pp)
    grad_bytes = trainable * work.precision.buffer_bytes
    # Unsharded accumulation reads and writes the buffer once per backward; Reweight also scales and sums
    # its Q per-sample buffers once per group.
    # (without FSDP every schedule accumulates into the parameters' own gradients alike: nothing extra)
    passes = 3 * max(mb * backwards - 1, 0) if coalesced(work, schedule) and layout.fsdp else 0
    if schedule == "reweight":  # the groups of its own block
        passes += shape.groups_per_rank * work.first_block * (shape.generations_per_rank + 1)
    buffer_traffic = passes * grad_bytes / (hw.hbm_gbps * 1e9)
    optimizer_bytes = trainable / shards * (4 * work.precision.storage_bytes + work.precision.grad_bytes)
    return {
        "rollout": n * rollout * rates.forward,
        # Native's recompute (in the later blocks too) and Reweight's KL part at pp > 1 (a forward of its own)
        "recompute": n * (forwards - rollout - (steps if kl else 0)) * rates.forward,
        "reference_forward": n * steps * rates.forward if kl else 0.0,
        "backward": n * backwards * rates.backward,
        "fsdp_all_gather": gathers * gather_seconds(work, hw, layout, arch),
        "tp_all_reduce": n * (forwards + backwards) * rates.tp_per_pass,
        "cp_all_to_all": n * (forwards * rates.cp_forward + backwards * rates.cp_backward),
        "grad_sync": sync_count(work, shape, schedule) * _sync_seconds(work, hw, layout, trainable, arch),
        "grad_buffers": buffer_traffic,
        "optimizer": work.updates_per_rollout * optimizer_bytes / (hw.hbm_gbps * 1e9),
        "reward": n * work.reward_seconds,
    }


@dataclass
class Estimate:
    """Predicted peak memory and step time of one (schedule, layout, checkpointing) choice."""

    schedule: str
    layout: Layout
    activation_checkpointing: bool
    shape: Optional[Shape]
    gather_mode: str = "forward"
    """FSDP2 gathering (:mod:`leangrpo_mcore.parallel.gathering`): forward, rollout or step."""
    peak_mem_bytes: int = 0
    peak_phase: str = ""
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    fits: bool = False
    feasible: bool = True
    note: str = ""
    max_selected_steps: Optional[int] = None
    details: dict = field(default_factory=dict)
    """Sizes behind the peak: activations per step, provisional-gradient bytes, gradient buffers."""
    phases: dict = field(default_factory=dict)
    """Every phase's terms (bytes), of which ``memory`` is the peak one."""

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return sum(self.time.values())

    def peak_excluding(self, *terms: str) -> int:
        """The peak over phases without ``terms`` (e.g. what already exists when a meter starts measuring:
        ``peak_excluding("weights", "optimizer", "reserved")`` for a step after the first)."""
        return max(sum(v for k, v in phase.items() if k not in terms) for phase in self.phases.values())


def estimate(work: Workload, hw: Hardware, layout: Layout, schedule: str, ac: bool,
             stage: Optional[int] = None) -> Estimate:
    """Memory and time of one choice; an infeasible layout gets ``feasible=False`` and the reason. The memory is
    that of pipeline stage ``stage`` (default: the heaviest one)."""
    mode = mode_of(work, layout, schedule)
    try:
        shape = sample_shape(work, layout)
    except UserError as err:
        return Estimate(schedule, layout, ac, None, mode, feasible=False, note=str(err))
    if refused_mode(work, layout, schedule, mode):
        return Estimate(schedule, layout, ac, shape, mode, feasible=False, note=refused_mode(work, layout, schedule,
                                                                                             mode))
    prec = work.precision
    if prec.storage_bytes != prec.compute_bytes and not layout.fsdp and layout.world_size > 1:
        # the trainer refuses it too: only FSDP2 casts master weights to the compute dtype (in a one-process world
        # it wraps the policy over a one-rank mesh to cast)
        return Estimate(schedule, layout, ac, shape, mode, feasible=False,
                        note="no data-parallel ranks: nothing casts the fp32 master weights to the compute dtype")
    if stage is None:
        stage, phases = heaviest_stage(work, hw, layout, schedule, ac)
    else:
        phases = memory_phases(work, hw, layout, schedule, ac, stage)
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    est = Estimate(schedule, layout, ac, shape, mode, peak_mem_bytes=sum(phases[phase].values()), peak_phase=phase,
                   memory=phases[phase], time=step_time(work, hw, layout, schedule, ac), phases=phases)
    est.fits = hw.gpu_mem_bytes is None or est.peak_mem_bytes <= hw.gpu_mem_bytes
    terms = _memory_terms(work, hw, layout, ac, stage, mode)
    est.details = {"heaviest_stage": stage,"activations_per_step_bytes": terms["activations_step"],
                   "activations_per_sample_bytes": terms["activations_sample_step"],
                   "gradient_bytes": terms["gradient_buffer"],
                   "provisional_grad_bytes": terms["gradient_buffer"] * terms["buffers"] if schedule == "reweight"
                   else 0}
    if schedule == "retain":
        est.max_selected_steps = max_selected_that_fit(work, hw, layout, schedule, ac)
    if shape.idle_fraction > 0:
        est.note = f"{shape.idle_fraction:.0%} of the worker-group slots idle"
    return est
