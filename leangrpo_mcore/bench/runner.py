"""Run the schedules side by side on one config, interleaved, from identical weights.

One policy, optimizer, prompt set and reward are built from the config; every schedule gets its own
:class:`~leangrpo_mcore.engine.step.StepEngine` over them. Rounds run the schedules in a fixed order
(A, B, C, A, B, C, …) so that slow drifts of the machine hit all of them alike; round r gives every schedule
the same prompts and seeds (step r), and before each step the weights, optimizer state and LR schedule are
restored (outside the timed region), so every step does the same work from the same state and the policy
never drifts. The first ``warmup`` rounds are discarded. Afterwards one untimed step per schedule measures
peak memory (the CPU meter runs the profiler, which would distort timings), and optionally one more
compares each schedule's gradient with Native's.

Native is also timed on every data-parallel layout the project can run it on, the strongest baseline
(:func:`~leangrpo_mcore.bench.arms.native_candidates`): FSDP2 sharded over all data-parallel ranks (``@sharded``)
and a replica on each (``@replicated``), each with per-backward and with coalesced gradient sync; the report
names the fastest next to FSDP2's. Each layout is built once (:class:`~leangrpo_mcore.bench.arms.Arm`).

Every rank runs the same loop; the report holds rank 0's measurements.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.bench.arms import (LAYOUTS, VARIANTS, Arm, build_arm, layout_config, layout_name,
                                       native_candidates, split_label, variant_config)
from leangrpo_mcore.bench.prediction import predicted_step
from leangrpo_mcore.bench.probe import synchronize
from leangrpo_mcore.bench.report import StepSample, finish_report, split_phases
from leangrpo_mcore.config import Config
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.launch import DistContext, raise_if_any
from leangrpo_mcore.engine.references import StepReferences
from leangrpo_mcore.engine.reward_bridge import RewardBridge
from leangrpo_mcore.engine.step import StepInputs, StepResult
from leangrpo_mcore.engine.throughput import step_throughput
from leangrpo_mcore.planner.flops import step_flops_for_config
from leangrpo_mcore.planner.workload import Layout
from leangrpo_mcore.schedules import SCHEDULES

__all__ = ["VARIANTS", "BenchOptions", "bench_document", "parse_schedules", "run_benchmark"]


def parse_schedules(text: str) -> list[str]:
    """``native,retain,native@replicated`` → the list of labels; ValueError for unknown or repeated labels."""
    labels = [item.strip() for item in text.split(",") if item.strip()]
    if not labels:
        raise ValueError("--schedules needs at least one schedule")
    unknown = [label for label in labels if split_label(label)[0] not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown schedule {unknown[0]!r}; valid: {', '.join(VARIANTS)}, each optionally @layout")
    layouts = [label for label in labels if split_label(label)[1] not in ("", *LAYOUTS)]
    if layouts:
        raise ValueError(f"unknown layout in {layouts[0]!r}; valid: {', '.join(LAYOUTS)}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"--schedules lists a schedule twice: {text}")
    return labels


@dataclass(frozen=True)
class BenchOptions:
    """What to run and measure."""

    schedules: tuple[str, ...] = ("native", "retain", "reweight")
    """Labels of :data:`VARIANTS`, in the interleaving order."""
    steps: int = 3
    """Measured steps per schedule."""
    warmup: int = 1
    """Discarded steps per schedule before the measured ones."""
    measure_memory: bool = True
    """One extra untimed step per schedule with the peak-memory meter."""
    check_parity: bool = False
    """One extra untimed step per schedule comparing its gradient with Native's."""
    title: str = ""
    """Heading of the run in the Markdown report."""
    baselines: bool = True
    """Also time every Native the project can run that ``schedules`` leave out (:func:`native_candidates`)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        parse_schedules(",".join(self.schedules))
        if self.check_parity and "native" not in self.schedules:
            raise ValueError("--check-parity compares against Native: include native in --schedules")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class Bench:
    """The built components: the data side once, an :class:`Arm` per data-parallel layout."""

    def __init__(self, config: Config, options: BenchOptions, dist_ctx: DistContext) -> None:
        self.config, self.options, self.dist = config, options, dist_ctx
        # The trainer's build order: cheap checks and the data side before the policy.
        pctx = build.build_context(config, dist_ctx)
        build.check_layout_early(config, pctx)
        source = build.resolve_model_source(config)  # model.path is read here, once
        self.data = build.build_data_parts(config, source.family, source.hyper, dist_ctx.device)
        self.bridge = RewardBridge(self.data, config)
        # every prompt slot's conditioning image, whatever the layouts of the arms (their samples may differ)
        self.references = None if self.data.images is None else StepReferences(
            self.data.images, self.data.decoder, source.family.name, range(config.grpo.prompts_per_step),
            build.reference_run(config, source.hyper))
        self._sources: Optional[dict] = None
        own = layout_name(int(pctx.layout.dp_shard), int(pctx.layout.dp_replicate))
        labels = list(options.schedules)
        if options.baselines:
            labels = native_candidates(labels, own, pctx.dp_size)
        self.labels = labels
        """Every timed label, in the interleaving order."""
        self.arms: dict[str, Arm] = {}
        self.arm_of: dict[str, Arm] = {}
        for layout in dict.fromkeys(self._layout_of(label, own) for label in labels):
            mine = [label for label in labels if self._layout_of(label, own) == layout]
            arm = build_arm(layout_config(config, "" if layout == own else layout, pctx.dp_size), mine, dist_ctx,
                            source, self.bridge, pctx if layout == own else None)
            self.arms[layout] = arm
            self.arm_of.update({label: arm for label in mine})
        self.main = self.arms[own]
        """The arm of the config's own layout (shape, parity)."""
        self.last_cpu_seconds = 0.0
        """Process CPU time of the last :meth:`step`."""
        self.grad_buffers: dict[str, int] = {}
        """Most provisional gradients held at once in a step, per label (Reweight)."""
        self.text_tokens: list[int] = []
        """Text tokens of each measured round's prompts (trimmed per step by a masked family)."""

    @staticmethod
    def _layout_of(label: str, own: str) -> str:
        return split_label(label)[1] or own

    def inputs(self, step: int) -> StepInputs:
        """The prompts and seeds of round ``step`` (the same for every schedule)."""
        ids = self.data.sampler.next_indices()
        conditioning = self.data.text_encoder.encode(self.data.dataset.get(ids))
        if self.references is not None:
            conditioning, self._sources = self.references.attach(conditioning, ids)
        return StepInputs(step=step, conditioning=conditioning, prompt_ids=torch.tensor(ids, dtype=torch.long))

    def step(self, label: str, inputs: StepInputs) -> tuple[float, StepResult]:
        """Restore the saved state, then run and time one step of ``label`` (wall seconds, result)."""
        arm = self.arm_of[label]
        engine = arm.engines[label]
        arm.snapshot.restore()
        self.bridge.begin_step(capture=False, sources=self._sources)
        arm.probe.begin_step(SCHEDULES[engine.plan.schedule].recompute_free)
        _barrier()
        synchronize(self.dist.device)
        begin, cpu_begin = time.perf_counter(), time.process_time()
        result = engine.step(inputs)
        synchronize(self.dist.device)
        seconds, self.last_cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu_begin
        raise_if_any(self.bridge.error)
        return seconds, result

    def measure(self) -> dict[str, list[StepSample]]:
        """Interleaved rounds; the measured steps of each label (warm-up rounds dropped)."""
        opts = self.options
        samples: dict[str, list[StepSample]] = {label: [] for label in self.labels}
        self.text_tokens = []
        for round_index in range(opts.warmup + opts.steps):
            inputs = self.inputs(round_index)
            if round_index >= opts.warmup:
                self.text_tokens.append(int(inputs.conditioning.encoder_hidden_states.shape[1]))
            for label in self.labels:
                seconds, result = self.step(label, inputs)
                self.grad_buffers[label] = max(u.max_local_grad_buffers for u in result.updates)
                if round_index < opts.warmup:
                    continue
                tally = self.arm_of[label].probe.tally
                samples[label].append(StepSample(seconds=seconds, cpu_seconds=self.last_cpu_seconds,
                                                 phases=split_phases(seconds, result.timings, tally),
                                                 forward_seconds=dict(tally.seconds), forward_rows=dict(tally.rows)))
        return samples

    def memory(self, inputs: StepInputs) -> dict[str, Optional[int]]:
        """Peak memory above the step's start per label (one untimed step each), or None when not measured."""
        out: dict[str, Optional[int]] = {}
        for label in self.labels:
            if not self.options.measure_memory:
                out[label] = None
                continue
            engine = self.arm_of[label].engines[label]
            engine.measure_memory = True
            try:
                out[label] = self.step(label, inputs)[1].peak_memory_bytes
            finally:
                engine.measure_memory = False
        return out

    def parity(self, inputs: StepInputs) -> dict[str, dict]:
        """Each label's first-update gradient against Native's on the same rollout (cosine, relative L2): the labels
        of the config's own layout (another layout's gradients are sharded otherwise)."""
        grads, rewards = {}, {}
        capture = self.main.capture
        for label in (label for label in self.labels if self.arm_of[label] is self.main):
            with capture.capturing():
                _, result = self.step(label, inputs)
            update = result.updates[0]
            scale = 1.0
            if update.clipped:
                # Undo the clip (it scales by max_norm / (norm + 1e-6)), so a wrong gradient scale shows up.
                scale = (update.grad_norm + 1e-6) / self.config.optim.max_grad_norm
            grads[label] = [None if g is None else g * scale for g in capture.grads]
            rewards[label] = result.rewards
        return {label: _compare(grads["native"], grads[label], rewards["native"], rewards[label])
                for label in grads if label != "native"}

    def timed_rounds(self) -> range:
        """The training-step numbers of the measured rounds (round r runs step r)."""
        return range(self.options.warmup, self.options.warmup + self.options.steps)

    def window_starts(self) -> list:
        """The shared SDE window's start in each measured round (None: no shared window)."""
        plan = next(iter(self.main.engines.values())).plan
        return [plan.window_start(step) for step in self.timed_rounds()]

    def shape(self) -> dict:
        """T, T' (the rollout's forwards, fewer when the steps after the SDE window are compressed), |S|, samples
        per rank, tokens and parameter counts of the benchmarked setup."""
        plan = next(iter(self.main.engines.values())).plan
        policy = self.main.parts.policy
        trainable = sum(p.numel() for p in self.main.params)
        forwards = [plan.rollout_sigmas(plan.window_start(step)).numel() - 1 for step in self.timed_rounds()]
        return {"family": self.config.model.family, "num_steps": plan.num_steps,
                "rollout_steps": sum(forwards) / len(forwards), "updates_per_rollout": plan.updates_per_rollout,
                "steps_per_sample": plan.steps_per_sample, "group_size": plan.group_size,
                "prompts_per_step": plan.prompts_per_step, "micro_batch": plan.micro_batch,
                "samples_per_rank": plan.prompts_per_step * plan.group_size // self.main.pctx.dp_size,
                "tokens": _tokens(self.config.model.family, plan.latent_shape, policy),
                "latent_shape": list(plan.latent_shape), "params": sum(p.numel() for p in policy.parameters()),
                "trainable_params": trainable, "lora_rank": self.config.model.lora.rank,
                "gradient_bytes": sum(p.numel() * p.element_size() for p in self.main.params),
                "dtype": self.config.model.dtype}

    def meta(self) -> dict:
        """Where and how the run was measured."""
        device = self.dist.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
        pctx = self.main.pctx
        return {"title": self.options.title, "world_size": self.dist.world_size, "dp_size": pctx.dp_size,
                "tp": pctx.layout.tp, "cp": pctx.layout.cp, "device": f"{device.type}: {name}",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(), "steps": self.options.steps, "warmup": self.options.warmup,
                "order": list(self.labels), "layout": self.main.layout,
                "reshard_after_forward": self.config.parallel.reshard_after_forward,
                "layouts": {label: arm.layout for label, arm in self.arm_of.items()}}

    def throughput(self) -> dict[str, dict]:
        """Per label: the FLOP count of its step (model FLOPs over all ranks, the sample-passes of one
        data-parallel rank by kind) and the throughput scalars' inputs, as the trainer logs them (a family that
        trims its prompts per step: the mean count over the measured rounds' text lengths)."""
        out = {}
        lengths = self.text_tokens
        for label, arm in self.arm_of.items():
            config, schedule = arm.config, arm.engines[label].plan.schedule
            meter = step_throughput(config, schedule, self.dist.world_size, self.dist.device)
            starts = [start for start in self.window_starts() if start is not None]
            flops = step_flops_for_config(config, schedule, window_start=starts[0] if starts else None)
            per_step = meter.flops_per_step
            if per_step is not None and meter.flops_for_text is not None and lengths:
                per_step = sum(meter.flops_for_text(n) for n in lengths) / len(lengths)
            out[label] = {"samples_per_step": meter.samples_per_step, "devices": meter.devices,
                          "flops_per_step": per_step, "peak_tflops": meter.peak_tflops,
                          "passes_per_rank": flops.per_rank_counts(arm.pctx.dp_size)}
        return out

    def predictions(self) -> dict[str, dict]:
        """Per label the planner's predicted step time (:func:`~leangrpo_mcore.bench.prediction.predicted_step`)."""
        out = {}
        for label, arm in self.arm_of.items():
            lay = arm.pctx.layout
            layout = Layout(tp=int(lay.tp), dp_shard=int(lay.dp_shard), dp_replicate=int(lay.dp_replicate),
                            cp=int(lay.cp), pp=int(lay.pp))
            out[label] = predicted_step(variant_config(arm.config, label), arm.engines[label].plan.schedule, layout,
                                        self.dist.world_size, self.dist.device.type, self.window_starts())
        return out

    def run(self) -> dict:
        """Measure, probe memory (and parity), restore the start state; the report of this run."""
        load_start = _load_average()
        samples = self.measure()
        load_end = _load_average()
        probe_inputs = self.inputs(self.options.warmup + self.options.steps)
        memory = self.memory(probe_inputs)
        parity = self.parity(probe_inputs) if self.options.check_parity else None
        for arm in self.arms.values():
            arm.snapshot.restore()
        meta = {**self.meta(), "load_average": {"start": load_start, "end": load_end}}
        report = finish_report({"meta": meta, "shape": self.shape()}, samples, self.throughput())
        predictions = self.predictions()
        for label, entry in report["schedules"].items():
            entry["peak_memory_bytes"] = memory[label]
            entry["local_grad_buffers"] = self.grad_buffers[label]
            entry["predicted"] = predictions[label]
        if parity is not None:
            report["parity"] = parity
        return report


def _load_average() -> Optional[list[float]]:
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none): a shared box shows here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _tokens(family: str, latent_shape: tuple[int, ...], policy: torch.nn.Module) -> int:
    """Image tokens the policy attends over: FLUX and Qwen-Image packed tokens, SD3 and Wan latent patches."""
    if family in ("flux", "qwen_image"):
        return int(latent_shape[0])
    if family == "sd3":
        patch = policy.config.patch_size
        return (int(latent_shape[1]) // patch) * (int(latent_shape[2]) // patch)
    patch = policy.config.to_diffusers_config()["patch_size"]
    return math.prod(int(n) // int(p) for n, p in zip(latent_shape[1:], patch))


def _compare(reference: list, grads: list, ref_rewards: torch.Tensor, rewards: torch.Tensor) -> dict:
    """Cosine and relative L2 distance of two gradient lists (local shards summed over all ranks)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for a, b in zip(reference, grads):
        a = torch.zeros(()) if a is None else a.double().cpu()
        b = torch.zeros(()) if b is None else b.double().cpu()
        sums += torch.stack([(a * b).sum(), (a * a).sum(), (b * b).sum(), ((a - b) ** 2).sum()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        sums = sums.to(device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    dot, ref_sq, other_sq, diff_sq = sums.tolist()
    cosine = dot / math.sqrt(ref_sq * other_sq) if ref_sq > 0 and other_sq > 0 else float("nan")
    return {"cosine": cosine, "rel_l2": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else float("nan"),
            "reward_max_abs_diff": float((ref_rewards.double() - rewards.double()).abs().max())}


def run_benchmark(config: Config, options: BenchOptions, dist_ctx: DistContext) -> dict:
    """Build everything for ``config`` and benchmark ``options.schedules``; the run's report (every rank)."""
    return Bench(config, options, dist_ctx).run()


def bench_document(runs: list[dict], sweep_key: Optional[str] = None, sweep_values: Optional[list] = None) -> dict:
    """The JSON document of one run or of a sweep (one run per value)."""
    sweep = None if sweep_key is None else {"key": sweep_key, "values": list(sweep_values or [])}
    return {"version": 1, "sweep": sweep, "runs": runs}
