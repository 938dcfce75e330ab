"""The :class:`~leangrpo_mcore.planner.workload.Workload` of an experiment config, as written (pure Python).

What :func:`leangrpo_mcore.planner.layout.plan_for_config` and ``leangrpo-plan --config`` plan: the
architecture, tokens, selected steps, dtypes and schedule options the config implies.
"""

from __future__ import annotations

from typing import Any, Optional

from leangrpo_mcore.config.window_rules import rollout_steps
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import (DEFAULT_LORA_TARGETS, ArchSpec, arch_from_config, load_arch,
                                                preset_config)
from leangrpo_mcore.planner.reward_specs import reward_memory
from leangrpo_mcore.planner.workload import GiB, Precision, Workload

DEFAULT_TEXT_TOKENS = 512  # T5 / UMT5 maximum length of the released FLUX and Wan pipelines
HASHED_TEXT_TOKENS = 16  # the hashed CPU text embedder's length (``engine.build.HASHED_TEXT_LENGTH``)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def precision_from_config(config: Any) -> Precision:
    """Bytes per tensor kind implied by ``model.dtype`` (compute), ``model.master_dtype``, ``model.fp8``,
    ``parallel.reduce_dtype`` and ``schedule.provisional_dtype``."""
    master = _DTYPE_BYTES[config.model.master_dtype or "float32"]
    compute = _DTYPE_BYTES[config.model.dtype]
    # The unsharded gradients wait in the provisional dtype (default: the reduce dtype, which is what FSDP2
    # accumulates in whenever it casts the forwards).
    provisional = config.schedule.provisional_dtype or config.parallel.reduce_dtype
    buffer = _DTYPE_BYTES[provisional] if compute < master or config.schedule.provisional_dtype else master
    name = "fp8" if config.model.fp8 else ("fp32" if compute == 4 else "bf16")
    return Precision(name, master, compute, master, buffer, matmul_speedup=2.0 if config.model.fp8 else 1.0)


def selected_steps_of(config: Any) -> int:
    """|S| per sample (the counts of ``leangrpo_mcore.diffusion.selection.num_selected``, kept torch-free)."""
    grpo, steps = config.grpo, config.sampler.num_steps
    if grpo.timestep_selection == "flow_grpo":
        count = int(steps * grpo.timestep_fraction)
    elif grpo.timestep_selection == "dance_grpo":
        count = int((steps - 1) * grpo.timestep_fraction)
    else:
        count = config.sampler.sde_window_size
    if count < 1:
        raise UserError(f"grpo.timestep_selection={grpo.timestep_selection} selects no step of {steps}")
    return count


def trained_steps_of(config: Any, arch: ArchSpec) -> int:
    """The selected steps a sample trains: |S|, or with one expert of two trained (``model.experts.train``) those
    of its steps that expert runs (:func:`expert_trained_steps` on the config's sigma schedule)."""
    count = selected_steps_of(config)
    if arch.experts == 1 or config.model.experts.train == "both":
        return count
    from leangrpo_mcore.engine.model_source import sampler_shift  # lazily: torch

    s = config.sampler
    return expert_trained_steps(arch, config.model.experts.train, s.sigma_schedule, s.num_steps,
                                sampler_shift(config), config.grpo.timestep_selection, count)


def expert_trained_steps(arch: ArchSpec, train: str, sigma_kind: str, num_steps: int, shift: float, selection: str,
                         count: int) -> int:
    """Of ``count`` selected steps of a two-expert policy, those the ``train`` expert runs on the ``sigma_kind``
    schedule (the first ``count`` under FlowGRPO's selection; the most a sample can have where the selection is
    drawn per sample or per group); at least 1."""
    # Imported lazily (torch): the engine's own split of the steps between the experts.
    from leangrpo_mcore.diffusion.selection import ExpertSteps
    from leangrpo_mcore.diffusion.sigmas import get_sigmas

    sigmas = get_sigmas(sigma_kind, num_steps, shift=shift)
    trained = ExpertSteps(float(arch.config["boundary_ratio"]) * 1000, sigma_kind, train).trained(sigmas)
    if selection == "flow_grpo":
        return max(1, int(trained[:count].sum()))
    candidates = trained[:-1] if selection == "dance_grpo" else trained
    return max(1, min(count, int(candidates.sum())))


def rollout_steps_of(config: Any, window_start: Optional[int] = None) -> float:
    """The policy forwards of one rollout (T', ``config.window_rules.rollout_steps``): T unless the steps after a shared
    SDE window are compressed; then at ``window_start``, or (None) the mean over the starts the window takes, each
    for as many optimizer steps (a fixed window's one start, a progressive window's sweep)."""
    s = config.sampler
    if not s.sde_window_size or not s.ode_steps_after_window or s.sde_window_schedule == "random":
        return float(s.num_steps)
    low, high = int(s.sde_window_range[0]), int(s.sde_window_range[-1])
    if window_start is not None:
        starts = [window_start]
    else:
        starts = [low] if s.sde_window_schedule == "fixed" else list(range(low, high, s.window_stride))
    counts = [rollout_steps(s.num_steps, k + s.sde_window_size, s.ode_steps_after_window) for k in starts]
    return sum(counts) / len(counts)


def reweight_plan_of(config: Any):
    """The schedule's own Reweight plan for ``config`` (accumulation after any fallback, global fold, note)."""
    # Imported lazily (torch): the schedule's own rule for when affine accumulation falls back to per-sample.
    from leangrpo_mcore.schedules.reweight import plan_reweight

    g = config.grpo
    return plan_reweight(config.schedule.reweight_accumulate, advantage=g.advantage, group_size=g.group_size,
                         prompts_per_step=g.prompts_per_step, adv_clip_max=g.adv_clip_max, global_std=g.global_std,
                         aggregate=config.reward.aggregate)


def arch_of(config: Any) -> ArchSpec:
    """The :class:`ArchSpec` of the config's policy (``model.path``, or ``model.preset`` with ``model.arch``)."""
    m = config.model
    if m.path:
        return load_arch(m.path)
    if not m.preset:
        raise UserError("model: set model.path or model.preset to plan")
    try:
        return arch_from_config(m.family, {**preset_config(m.family, m.preset), **m.arch}, m.preset)
    except ValueError as err:  # the models registry reports unknown families / presets as ValueError
        raise UserError(str(err)) from None


def tokens_of(config: Any, arch: ArchSpec, text_tokens: Optional[int] = None) -> dict[str, int]:
    """Tokens per sample of each stream at the config's resolution (the conditioning image's with
    ``data.images``); ``text_tokens`` defaults to the text encoder's length (``model.text_max_length``, 16 for the
    hashed CPU embedder)."""
    m, s = config.model, config.sampler
    if text_tokens is None:
        text_tokens = HASHED_TEXT_TOKENS if m.text_encoder == "hashed" else m.text_max_length
    return arch.tokens(s.height, s.width, s.frames, text_tokens, reference=config.data.images)


def workload_from_config(config: Any, *, text_tokens: Optional[int] = None, reward_seconds: float = 0.0,
                         reward_mem_gb: float = 0.0, decode_bytes: int = 0) -> Workload:
    """The :class:`Workload` of an experiment config, as written.

    ``text_tokens`` defaults to the text encoder's length: ``model.text_max_length`` (T5 / UMT5: 512), 16 for the
    hashed CPU embedder. A learned reward's model and scoring activations come from ``reward``
    (:mod:`leangrpo_mcore.planner.reward_specs`); ``reward_mem_gb`` reserves more on every rank (e.g. a plugin's
    model).
    """
    m, s = config.model, config.sampler
    arch = arch_of(config)
    tokens = tokens_of(config, arch, text_tokens)
    # null targets: the family's default set (as ``engine.build`` resolves them)
    targets = DEFAULT_LORA_TARGETS[arch.family] if m.lora.targets is None else tuple(m.lora.targets)
    scorer = reward_memory(config.reward)
    return Workload(
        arch=arch, tokens=tokens, num_steps=s.num_steps, selected_steps=trained_steps_of(config, arch),
        rollout_steps=rollout_steps_of(config), keep_means=config.grpo.ratio_norm,
        group_size=config.grpo.group_size, prompts_per_step=config.grpo.prompts_per_step,
        micro_batch=config.schedule.micro_batch, lora_rank=m.lora.rank, lora_targets=targets,
        precision=precision_from_config(config),
        activation_checkpointing=None if m.activation_checkpointing == "auto" else m.activation_checkpointing,
        kl_beta=config.grpo.kl_beta, cfg=s.cfg_scale > 1.0, updates_per_rollout=config.grpo.updates_per_rollout,
        reward_seconds=reward_seconds, reward_mem_bytes=int(reward_mem_gb * GiB), decode_bytes=decode_bytes,
        reward_model_bytes=scorer.weights_bytes, reward_activation_bytes=scorer.activation_bytes,
        reward_model=scorer.name, optimizer=config.optim.name,
        momentum=config.optim.momentum, reshard_after_forward=_reshard(config.parallel.reshard_after_forward),
        selection=config.grpo.timestep_selection,
        reweight_accumulate=reweight_plan_of(config).accumulate, coalesce_sync=config.schedule.coalesce_sync,
        global_std=config.grpo.global_std, reweight_global_fold=reweight_plan_of(config).global_fold,
        reweight_note=reweight_plan_of(config).note,
        layout=config.parallel.layout, async_scoring=config.reward.async_scoring,
        experts_train=config.model.experts.train)


def _reshard(value: Any) -> Any:
    """``parallel.reshard_after_forward`` for the workload: null is auto (the planner tries every mode)."""
    return "auto" if value is None else value
