"""Build every component of a run from its :class:`~leangrpo_mcore.config.schema.Config`.

Order matters and is fixed by the trainer: megatron TP groups and the data-parallel mesh first (the policy is
built TP-sliced); then everything that can reject bad input cheaply, read from the config and the checkpoint's
metadata without loading weights (layout, paths, the data side: prompts, text conditioning, VAE, reward); then
the policy, LoRA, the record of TP attributes (FSDP2 drops them), FSDP2, the optimizer and its LR schedule; last
the step engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from leangrpo_mcore.config.schema import Config, RewardConfig as RewardSection
from leangrpo_mcore.data.conditioning import TextDims, TextEncoder, build_text_encoder
from leangrpo_mcore.data.images import ConditioningImages, ImageFiles, ImageReader
from leangrpo_mcore.data.prompts import PromptDataset, PromptSampler
from leangrpo_mcore.data.reference import ReferenceRun, check_image_conditioning
from leangrpo_mcore.data.vae import PACKED_FAMILIES, LatentDecoder, build_vae, latent_shape
from leangrpo_mcore.diffusion.selection import ExpertSteps
from leangrpo_mcore.diffusion.sigmas import SigmaSpec
from leangrpo_mcore.diffusion.velocity import build_velocity_fn
from leangrpo_mcore.models.common.tp import TPLayout, capture_tp_layout
from leangrpo_mcore.engine.auto_layout import (apply_choice, auto_keys, chosen_words, describe_inputs,
                                               planning_inputs, unplanned)
from leangrpo_mcore.engine.launch import DistContext
from leangrpo_mcore.engine.model_source import ModelSource, lora_section, resolve_model_source, sampler_shift
from leangrpo_mcore.engine.optim import build_lr_scheduler, build_optimizer, trainable_parameters
from leangrpo_mcore.engine.step import RewardFn, StepEngine, StepPlan
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.vae_factors import spatial_factor
from leangrpo_mcore.models import apply_lora, mark_only_lora_trainable
from leangrpo_mcore.models.backends import resolve_backend
from leangrpo_mcore.models.registry import ModelFamily, materialize, meta_policy
from leangrpo_mcore.models.wan.experts import boundary_timestep
from leangrpo_mcore.parallel.groups import check_layout
from leangrpo_mcore.parallel.fsdp import apply_fsdp
from leangrpo_mcore.models.common.pipeline import PipelineStage, split_blocks
from leangrpo_mcore.parallel.mesh import Layout, ParallelContext, build_parallel_context
from leangrpo_mcore.parallel.stages import StageLink, StagedVelocity
from leangrpo_mcore.parallel.precision import RunPrecision, fp8_precision, null_precision, run_precision, torch_dtype
from leangrpo_mcore.rl.rewards import ValidatedReward, build_reward

HASHED_TEXT_LENGTH = 16
"""Token count of the hashed text embedder: prompts are short and the tiny CPU policies attend over every
text token, so the T5 length of 512 would only add padding."""


@dataclass
class PolicyParts:
    """The trained policy and what checkpoints need to know about it."""

    policy: torch.nn.Module
    family: ModelFamily
    tp_layout: TPLayout
    """TP attributes of every parameter, recorded before FSDP2 wrapping."""
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: Optional[dict[str, torch.Tensor]]
    """fp32 EMA shadow per trainable parameter name (same sharding as the parameter), or None."""


@dataclass
class DataParts:
    """Prompts, conditioning, decoding and reward."""

    dataset: PromptDataset
    sampler: PromptSampler
    text_encoder: TextEncoder
    decoder: LatentDecoder
    reward: Optional[ValidatedReward]
    """None on ranks that never score (:func:`scores_samples`): they load no reward model."""
    images: Optional[ConditioningImages] = None
    """The training prompts' conditioning images (``data.images``), or None."""


def scores_samples(pctx: ParallelContext) -> bool:
    """Whether this rank decodes and scores samples: CP rank 0 of the last pipeline stage (every TP rank of it)."""
    return pctx.cp_rank == 0 and pctx.pp_rank == int(pctx.layout.pp) - 1


def scoring_reward(build_fn, pctx: ParallelContext):
    """``build_fn()`` on the ranks that score (None elsewhere); a UserError on any of them stops every rank with
    its line (collective), so that no rank waits in a later collective for one that failed."""
    from leangrpo_mcore.engine.launch import raise_if_any

    reward, error = None, None
    if scores_samples(pctx):
        try:
            reward = build_fn()
        except UserError as err:
            error = str(err)
    raise_if_any(error)
    return reward


def resolve_plan(config: Config, dist_ctx: DistContext, logger: logging.Logger) -> Config:
    """``config`` with its ``auto`` keys (``schedule.name``, ``parallel.dp_shard``, ``parallel.dp_replicate``,
    ``parallel.reshard_after_forward``, ``model.activation_checkpointing``) set to the layout planner's fastest
    choice that fits the memory of a rank (:mod:`leangrpo_mcore.engine.auto_layout`); the choice is logged in one
    line. Identical on every rank (collective: the ranks agree on the memory first). A config the planner
    cannot model, or where nothing is predicted to fit, keeps the runtime defaults with a warning, unless
    ``schedule.name`` is auto (then the planner's refusal is the error)."""
    keys = auto_keys(config)
    if not keys:
        return config
    schedule_auto = config.schedule.name == "auto"
    if schedule_auto and config.parallel.cp > 1:
        raise UserError("schedule.name=auto with parallel.cp > 1 is not supported yet: plan the layout with "
                        "leangrpo-plan (it models context parallelism) and name its schedule")
    inputs = planning_inputs(config, dist_ctx)
    # The runtime's one way into the planner (its package entry), imported here so that a run without auto keys
    # never loads it.
    from leangrpo_mcore.planner import hardware_preset, override_values, plan_for_config

    try:
        plan = plan_for_config(config, inputs.world_size, gpus_per_node=inputs.ranks_per_node,
                               gpu_mem_gb=inputs.memory_gb, require=schedule_auto, **hardware_preset(inputs.hardware))
    except UserError as err:
        if schedule_auto:
            raise
        logger.warning("auto layout: the planner cannot plan this config (%s); running the default layout", err)
        return unplanned(config)
    if not plan.ok:
        logger.warning("auto layout: %s for %s; running the default layout", plan.reason, describe_inputs(inputs))
        return unplanned(config)
    logger.info("%s", chosen_words(plan.overrides, plan.reason, inputs))
    return apply_choice(config, override_values(plan.chosen))


def build_context(config: Config, dist_ctx: DistContext) -> ParallelContext:
    """Megatron TP groups + the data-parallel DeviceMesh for the live world size."""
    return build_parallel_context(Layout.from_config(config.parallel), dist_ctx.device)


def policy_hyper(config: Config) -> tuple[ModelFamily, dict]:
    """The family and diffusers-style hyper-parameters of the policy ``config`` trains (one
    :func:`resolve_model_source`; a caller that also builds the policy keeps the source instead)."""
    source = resolve_model_source(config)
    return source.family, source.hyper


def check_layout_early(config: Config, pctx: ParallelContext) -> None:
    """The prompt-group layout must split evenly over the data-parallel ranks (checked before any heavy work)."""
    g, layout = config.grpo, config.parallel.layout
    try:
        check_layout(layout, pctx.dp_size, g.group_size, g.prompts_per_step)
    except ValueError as err:
        raise UserError(f"grpo.group_size={g.group_size}, grpo.prompts_per_step={g.prompts_per_step} and "
                        f"parallel.layout={layout} do not fit {pctx.dp_size} data-parallel ranks: {err}") from None


def check_precision(config: Config) -> RunPrecision:
    """The run's dtypes from the config alone (before any planning); ValueError for dtypes that contradict each
    other, UserError for FP8 asked for without Transformer Engine."""
    m = config.model
    if m.fp8 is not None and resolve_backend(m.backend) != "te":
        raise UserError(f"model.fp8={m.fp8} needs the Transformer Engine backend (model.backend=te or auto, with "
                        f"transformer_engine installed and a CUDA device); set model.fp8=null here")
    return run_precision(config.model, config.parallel, config.schedule)


def precision_of(config: Config, pctx: ParallelContext) -> RunPrecision:
    """The run's dtypes (:func:`check_precision`); UserError when forwards must be cast but nothing can cast
    them."""
    precision = check_precision(config)
    if precision.casts and pctx.dp_mesh is None and pctx.world_size > 1:
        raise UserError(f"model.dtype={precision.compute} under model.master_dtype={precision.master} needs FSDP2 "
                        f"to cast the weights, and tensor parallelism alone (no data parallelism) has none: set "
                        f"model.master_dtype={precision.compute} or add data-parallel ranks")
    return precision


def build_policy_parts(config: Config, pctx: ParallelContext, precision: RunPrecision, *,
                       source: Optional[ModelSource] = None, fill_values: bool = True) -> PolicyParts:
    """Policy (+LoRA) built on the meta device, TP layout record, FSDP2 (casting to the compute dtype) applied on
    the meta model, then only this rank's shards allocated in the master dtype and filled (seeded init, or read
    box by box from ``model.path``; not at all with ``fill_values=False``, for a simulation); then optimizer, LR
    schedule and EMA shadows. No rank holds the full model."""
    m = config.model
    source = source if source is not None else resolve_model_source(config)
    family, model_config, files = source.family, source.config, source.files
    stage = pipeline_stage(model_config.num_layers, pctx)
    policy = meta_policy(family, model_config, m.backend, torch_dtype(precision.master), source.stored_lora,
                         stage=stage)
    lora = config.model.lora
    if lora.rank > 0 and getattr(policy, "lora_config", None) is None:
        with torch.device("meta"):  # a stage may hold none of a target's modules; the whole model holds them all
            apply_lora(policy, lora_section(lora, family), seed=m.seed, require_match=stage is None)
    if getattr(policy, "lora_config", None) is not None:
        mark_only_lora_trainable(policy)
    freeze_experts(policy, m.experts.train)
    if any(not p.requires_grad for p in policy.parameters()):
        _frozen_in(policy, torch_dtype(precision.compute))
    tp_layout = capture_tp_layout(policy)
    materialize(policy, pctx.device, seed=m.seed, files=files, layout=tp_layout,
                wrap=lambda model: apply_fsdp(model, pctx, param_dtype=precision.compute,
                                              reduce_dtype=precision.reduce, cast_only=precision.casts),
                fill_values=fill_values)
    params = trainable_parameters(policy)
    optimizer = build_optimizer(params, config.optim)
    # the scheduler steps with the optimizer: grpo.updates_per_rollout times per training step
    scheduler = build_lr_scheduler(optimizer, config.optim, config.train.max_steps * config.grpo.updates_per_rollout)
    ema = None
    if config.train.ema_decay > 0:
        ema = {name: p.detach().clone().float() for name, p in policy.named_parameters() if p.requires_grad}
    return PolicyParts(policy, family, tp_layout, optimizer, scheduler, ema)


def pipeline_stage(num_blocks: int, pctx: ParallelContext) -> Optional[PipelineStage]:
    """This rank's pipeline stage of a policy of ``num_blocks`` blocks (None at ``parallel.pp`` = 1)."""
    pp = int(pctx.layout.pp)
    if pp == 1:
        return None
    try:
        return split_blocks(num_blocks, pp)[pctx.pp_rank]
    except ValueError as err:
        raise UserError(f"parallel.pp={pp}: {err}") from None


def freeze_experts(policy: torch.nn.Module, train: str) -> None:
    """``model.experts.train``: with ``high`` or ``low`` the other expert of a two-expert policy is frozen, its
    adapters too (its parameters get no gradient and no optimizer state)."""
    if train == "both":
        return
    frozen = policy.expert("low" if train == "high" else "high")
    for param in frozen.parameters():
        param.requires_grad_(False)


def _frozen_in(policy: torch.nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters (a LoRA base, a frozen expert) of the meta policy in the compute ``dtype``: they are never
    updated, so a master copy would only double them (a 12B base: 45 GiB in fp32 instead of 22 GiB); forwards see
    the same values, since FSDP2 casts them to the compute dtype anyway."""
    for module in policy.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or param.dtype == dtype:
                continue
            frozen = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
            for attr, value in vars(param).items():
                setattr(frozen, attr, value)
            module._parameters[name] = frozen


def _reward(config: Config) -> ValidatedReward:
    """The configured reward, built (and a plugin imported) now, so that a bad name or option fails at start."""
    r = config.reward
    if r.aggregate == "advantages" and r.name != "weighted":
        raise UserError(f"reward.aggregate=advantages needs reward.name=weighted (one advantage per reward of "
                        f"reward.weights), got reward.name={r.name}")
    if r.aggregate == "advantages" and r.normalize:
        raise UserError("reward.aggregate=advantages already normalises each reward into its group advantage: "
                        "set reward.normalize=false")
    return check_reward_images(reward_of(r), config, "reward")


def check_reward_images(reward: ValidatedReward, config: Config, key: str) -> ValidatedReward:
    """``reward``, unless it compares samples with their conditioning images in a run that has none (UserError)."""
    if reward.needs_reference_images and not config.data.images:
        raise UserError(f"{key}: reward '{reward.name}' compares each sample with its conditioning image: set "
                        "data.images=true (a dataset whose rows name their images)")
    return reward


def reward_of(r: RewardSection) -> ValidatedReward:
    """The reward a reward section describes (the training reward, or one of ``eval.rewards``)."""
    dedicated: dict = {}
    if r.name == "weighted":
        if not r.weights:
            raise UserError("reward.name=weighted needs reward.weights ({reward name: weight})")
        dedicated = {"weights": r.weights, "normalize": r.normalize}
    elif r.name == "remote":
        if not r.url:
            raise UserError("reward.name=remote needs reward.url")
        dedicated = {"url": r.url, "timeout_s": r.timeout_s, "retries": r.retries,
                     "max_response_bytes": r.max_response_bytes, "auth_env": r.auth_env, "ca_bundle": r.ca_bundle}
    twice = sorted(set(dedicated) & set(r.options))
    if twice:
        raise UserError(f"reward.options.{twice[0]} repeats reward.{twice[0]}: set it in one place")
    return build_reward(r.name, **dedicated, **r.options)


def build_data_parts(config: Config, family: ModelFamily, diffusers_config: dict, device: torch.device,
                     pctx: Optional[ParallelContext] = None) -> DataParts:
    """Prompt dataset and sampler, text encoder, VAE decoder and reward for a policy of ``diffusers_config`` (the
    reward only on the ranks that score under ``pctx``; every rank without one)."""
    dataset = prompts_from("data.prompts", config.data.prompts, "train")
    sampler = PromptSampler(len(dataset), config.grpo.prompts_per_step, seed=config.train.seed,
                            shuffle=config.data.shuffle)
    images = conditioning_images(config, family, dataset, "data.prompts", device, diffusers_config)
    text, decoder = build_text_and_vae(config, family, diffusers_config, device)
    reward = _reward(config) if pctx is None else scoring_reward(lambda: _reward(config), pctx)
    return DataParts(dataset, sampler, text, decoder, reward, images)


def reference_run(config: Config, diffusers_config: dict) -> ReferenceRun:
    """What a family's reference encoder may depend on: the checkpoint's hyper-parameters and the run's frames."""
    return ReferenceRun(hyper=dict(diffusers_config), frames=config.sampler.frames,
                        image_encoder_path=config.model.image_encoder_path)


def first_frame_conditioning(config: Config, family_name: str, diffusers_config: dict) -> bool:
    """Whether the run conditions a Wan policy on an image in place of the first latent frame (``data.images``
    with a checkpoint of as many input as output channels: Wan2.2-TI2V's image-to-video)."""
    hyper = diffusers_config
    return (config.data.images and family_name == "wan"
            and int(hyper["in_channels"]) == int(hyper.get("out_channels") or hyper["in_channels"]))


def conditioning_images(config: Config, family: ModelFamily, dataset: PromptDataset, key: str,
                        device: torch.device, diffusers_config: dict) -> Optional[ConditioningImages]:
    """The conditioning images of ``dataset`` (config key ``key``) at the sampler's resolution with
    ``data.images``, else None; every row's file is checked to exist now."""
    if not config.data.images:
        return None
    check_image_conditioning(family.name, reference_run(config, diffusers_config))
    batch = max(config.grpo.prompts_per_step, config.schedule.micro_batch)
    reader = ImageReader(config.sampler.height, config.sampler.width, device=device, batch_size=batch)
    return ConditioningImages(ImageFiles.of(dataset, key), reader)


def prompts_from(key: str, source: str, split: str) -> PromptDataset:
    """The prompts of config key ``key`` (``split`` of a dataset directory); a bad source is one line naming ``key``."""
    try:
        return PromptDataset.from_source(source, split=split)
    except UserError as err:
        raise UserError(f"{key}: {err}") from None


def build_text_and_vae(config: Config, family: ModelFamily, diffusers_config: dict,
                       device: torch.device) -> tuple[TextEncoder, LatentDecoder]:
    """The text encoder and the VAE decoder of a policy of ``diffusers_config``."""
    m, s, fam = config.model, config.sampler, family.name
    conditioned = fam == "wan" and (diffusers_config.get("image_dim") is not None
                                    or int(diffusers_config["in_channels"]) > int(diffusers_config["out_channels"]))
    if conditioned and not config.data.images:
        raise UserError("this Wan checkpoint is image-to-video (it reads a conditioning image at every step): set "
                        "data.images=true with a prompt set whose rows name their images (docs/models.md, \"Wan "
                        "image-to-video\")")
    if m.image_encoder_path is not None and not (fam == "wan" and config.data.images
                                                 and diffusers_config.get("image_dim") is not None):
        raise UserError("model.image_encoder_path is read only by a run with data.images=true of a Wan checkpoint "
                        "that reads CLIP image tokens (image_dim in its config, Wan2.1-I2V)")
    max_length = HASHED_TEXT_LENGTH if m.text_encoder == "hashed" else m.text_max_length
    dims = TextDims.for_policy(fam, diffusers_config, max_length=max_length)
    guidance = s.guidance_scale if diffusers_config.get("guidance_embeds") else None
    negative = s.negative_prompt if s.cfg_scale > 1.0 else None
    text = build_text_encoder(m, fam, dims, negative_prompt=negative, guidance=guidance, seed=m.seed,
                              device=device)
    channels, factor = latent_channels(family, diffusers_config), spatial_factor(fam, diffusers_config)
    latent_shape(fam, s.height, s.width, s.frames, channels, spatial_factor=factor)  # before any weights load
    decoder = build_vae(m.vae, fam, m.vae_path, seed=m.seed, latent_channels=channels, spatial_factor=factor,
                        device=device)
    return text, decoder


def latent_channels(family: ModelFamily, diffusers_config: dict) -> int:
    """VAE latent channels of a policy (FLUX and Qwen-Image pack 2x2 patches: in_channels = 4 C; a Wan
    image-to-video checkpoint reads its conditioning channels beside the latents: its out_channels)."""
    channels = int(diffusers_config["in_channels"])
    if family.name == "wan":
        return int(diffusers_config.get("out_channels") or channels)
    return channels // 4 if family.name in PACKED_FAMILIES else channels


def policy_latent_shape(config: Config, policy: torch.nn.Module, family: ModelFamily) -> tuple[int, ...]:
    """Shape of one sampler latent of ``policy`` at the sampler's resolution and frames."""
    s, hyper = config.sampler, policy.config.to_diffusers_config()
    factor, channels = spatial_factor(family.name, hyper), latent_channels(family, hyper)
    shape = latent_shape(family.name, s.height, s.width, s.frames, channels, spatial_factor=factor)
    if first_frame_conditioning(config, family.name, hyper):  # the image is the first frame: sample the others
        return (shape[0], shape[1] - 1, *shape[2:])
    return shape


def sigma_spec(config: Config, shape: tuple[int, ...]) -> SigmaSpec:
    """The formula of the sampler's schedule (FLUX's and Qwen-Image's shift from the token count of ``shape``)."""
    s = config.sampler
    if s.sigma_schedule in ("flux", "qwen_image"):
        return SigmaSpec(s.sigma_schedule, image_seq_len=shape[0])
    return SigmaSpec(s.sigma_schedule, shift=sampler_shift(config))


def sigma_schedule(config: Config, num_steps: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The (num_steps + 1,) sigmas of the sampler's schedule (FLUX's and Qwen-Image's shift from the token count of ``shape``)."""
    return sigma_spec(config, shape).sigmas(num_steps)


def build_velocity(config: Config, parts: PolicyParts, pctx: ParallelContext, *, cfg_scale: float):
    """The policy's velocity function with classifier-free guidance ``cfg_scale``, across the pipeline stages at
    ``parallel.pp`` > 1 (the step engine and the evaluator split it over the CP ranks themselves)."""
    s, fam, hyper = config.sampler, parts.family.name, parts.policy.config.to_diffusers_config()
    factor = spatial_factor(fam, hyper)
    velocity = build_velocity_fn(fam, parts.policy, sigma_kind=s.sigma_schedule, latent_height=s.height // factor,
                                 latent_width=s.width // factor, cfg_scale=cfg_scale,
                                 first_frame=first_frame_conditioning(config, fam, hyper))
    if pctx.layout.pp > 1:
        compute = run_precision(config.model, config.parallel, config.schedule).compute
        velocity = StagedVelocity(velocity, StageLink(pctx, torch_dtype(compute)))
    return velocity


def build_engine(config: Config, schedule: str, parts: PolicyParts, pctx: ParallelContext,
                 reward_fn: RewardFn) -> StepEngine:
    """Sigma schedule, velocity function and the step engine of the configured schedule."""
    s = config.sampler
    shape = policy_latent_shape(config, parts.policy, parts.family)
    spec = sigma_spec(config, shape)
    velocity = build_velocity(config, parts, pctx, cfg_scale=s.cfg_scale)
    plan = StepPlan.from_config(config, latent_shape=shape, sigmas=spec.sigmas(s.num_steps), schedule=schedule,
                                sigma_spec=spec)
    ratio = getattr(parts.policy.config, "boundary_ratio", None)
    if ratio is not None:
        plan = dataclasses.replace(plan, experts=ExpertSteps(boundary_timestep(ratio), s.sigma_schedule,
                                                             config.model.experts.train))
    precision = fp8_precision(parts.policy) if config.model.fp8 else null_precision
    return StepEngine(plan, policy=parts.policy, velocity_fn=velocity, ctx=pctx, optimizer=parts.optimizer,
                      reward_fn=reward_fn, lr_scheduler=parts.lr_scheduler, precision=precision,
                      measure_memory=config.logging.measure_memory)
