"""The resolved settings of a training step (:class:`StepPlan`): what the config asks, checked for exactness."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from leangrpo_mcore.config.schema import Config
from leangrpo_mcore.config.window_rules import is_ratio
from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.selection import ExpertSteps, check_selection, num_selected
from leangrpo_mcore.diffusion.sigmas import SigmaSpec
from leangrpo_mcore.diffusion.window import SDEWindow, optimizer_steps_before, rollout_schedule
from leangrpo_mcore.parallel.gathering import ReshardValue, gather_mode, selection_varies_across_ranks
from leangrpo_mcore.parallel.groups import check_layout, check_updates
from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.rl.advantages import weighted_sum
from leangrpo_mcore.schedules.base import Objective
from leangrpo_mcore.schedules.reweight import ReweightPlan, plan_reweight


@dataclass(frozen=True)
class StepPlan:
    """The resolved settings of a training step; :meth:`validate` refuses anything that cannot be exact."""

    schedule: str
    """Schedule of the first update: native, retain or reweight."""
    group_size: int
    """M, generations per prompt."""
    prompts_per_step: int
    """P, prompt groups per step over all ranks."""
    latent_shape: tuple[int, ...]
    """Shape of one sampler latent (FLUX: packed tokens × channels; Wan: C, F, H, W)."""
    sigmas: torch.Tensor
    """(T+1,) float32 sigma schedule."""
    sde: SDEParams
    """SDE variant and constants."""
    objective: Objective
    """Clip range and KL settings."""
    selection: dict
    """select_steps settings: method, fraction, window_size, window_range."""
    advantage: str = "flow_grpo"
    """Advantage estimator name."""
    adv_clip_max: Optional[float] = 5.0
    """Advantage clamp (None: none)."""
    global_std: bool = False
    """Normalise advantages by the std of the whole step's rewards."""
    layout: str = "shared"
    """Data-parallel layout of the samples (parallel.groups)."""
    micro_batch: int = 1
    """Samples per policy forward."""
    updates_per_rollout: int = 1
    """Optimizer steps per rollout (blocks of prompt groups)."""
    sync: Optional[str] = None
    """Gradient sync of Native/Retain: per_backward, coalesced, or None (Native per backward, Retain coalesced)."""
    reweight_accumulate: str = "per_sample"
    """Reweight's provisional-gradient accumulation: per_sample or affine."""
    provisional_dtype: Optional[str] = None
    """Reweight's provisional-gradient dtype (None: as the backward leaves them)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: off)."""
    seed: int = 0
    """train.seed: every random draw derives from it."""
    same_latent: bool = False
    """Share the initial noise within a prompt group."""
    reshard_after_forward: ReshardValue = "auto"
    """parallel.reshard_after_forward: true, false, "rollout", or an unresolved auto (see :func:`gather_mode`)."""
    async_scoring: bool = False
    """reward.async_scoring: score each group in the background during the next group's rollout."""
    reward_weights: Optional[tuple[float, ...]] = None
    """reward.aggregate=advantages: the weights w_k of the K component rewards ``reward_fn`` returns as (B, K),
    each normalised into its own group advantage, A = clamp(Σ_k w_k A_k). None: (B,) rewards, one advantage."""
    window: Optional[SDEWindow] = None
    """Where the SDE window sits and the compression after it, with ``selection``'s size and range (None:
    FlowGRPO-Fast's random window per prompt group)."""
    ode_solver: str = "euler"
    """Solver of the ODE steps outside the SDE window: euler or dpmpp_2m."""
    experts: Optional[ExpertSteps] = None
    """A two-expert policy's split of the steps and which expert trains (None: one transformer)."""
    ode_before_window: str = "same"
    """sampler.ode_solver_before_window: same (``ode_solver``) or euler before a row's SDE window."""
    sigma_spec: Optional[SigmaSpec] = None
    """The formula of ``sigmas`` (re-spaces the tail after the window for a ratio of steps; None: no ratio)."""

    @classmethod
    def from_config(cls, cfg: Config, *, latent_shape: tuple[int, ...], sigmas: torch.Tensor,
                    schedule: Optional[str] = None, sigma_spec: Optional[SigmaSpec] = None) -> "StepPlan":
        """From a :class:`Config` (``schedule`` overrides ``cfg.schedule.name``, e.g. after the planner;
        ``sigma_spec`` the formula of ``sigmas``)."""
        s, g = cfg.sampler, cfg.grpo
        window = s.sde_window_size
        return cls(
            schedule=schedule or cfg.schedule.name, group_size=g.group_size, prompts_per_step=g.prompts_per_step,
            latent_shape=tuple(latent_shape), sigmas=sigmas.to(torch.float32),
            sde=SDEParams.from_sigmas(s.sde_kind, s.noise_level, sigmas),
            objective=Objective(clip_range=g.clip_range, kl_beta=g.kl_beta, kl_form=g.kl_form,
                                ratio_norm=g.ratio_norm, grad_reweight=g.grad_reweight),
            selection={"method": g.timestep_selection, "fraction": g.timestep_fraction, "window_size": window,
                       "window_range": tuple(s.sde_window_range)},
            advantage=g.advantage, adv_clip_max=g.adv_clip_max, global_std=g.global_std,
            layout=cfg.parallel.layout, micro_batch=cfg.schedule.micro_batch,
            updates_per_rollout=g.updates_per_rollout, sync="coalesced" if cfg.schedule.coalesce_sync else None,
            reweight_accumulate=cfg.schedule.reweight_accumulate, max_grad_norm=cfg.optim.max_grad_norm,
            provisional_dtype=cfg.schedule.provisional_dtype or cfg.parallel.reduce_dtype,
            seed=cfg.train.seed, same_latent=s.same_latent,
            reshard_after_forward=cfg.parallel.reshard_after_forward, async_scoring=cfg.reward.async_scoring,
            reward_weights=(tuple(float(w) for w in (cfg.reward.weights or {}).values())
                            if cfg.reward.aggregate == "advantages" else None),
            window=SDEWindow(size=window, low=int(s.sde_window_range[0]), high=int(s.sde_window_range[-1]),
                             schedule=s.sde_window_schedule, stride=s.window_stride,
                             shift_every=s.window_shift_every, ode_steps_after=s.ode_steps_after_window or 0),
            ode_solver=s.ode_solver, ode_before_window=s.ode_solver_before_window, sigma_spec=sigma_spec,
        )

    @property
    def sde_window(self) -> SDEWindow:
        """The SDE window settings (:attr:`window`, or a random window of ``selection``'s size and range)."""
        if self.window is not None:
            return self.window
        bounds = self.selection.get("window_range", (0, 1))
        return SDEWindow(size=self.selection.get("window_size", 0), low=int(bounds[0]), high=int(bounds[-1]))

    def window_start(self, step: int) -> Optional[int]:
        """The start of training step ``step``'s shared SDE window (None: drawn per prompt group, or no window):
        a function of the optimizer steps before it, so a resumed run continues where it stopped."""
        return self.sde_window.start(optimizer_steps_before(step, self.updates_per_rollout))

    def rollout_sigmas(self, window_start: Optional[int]) -> torch.Tensor:
        """The (T'+1,) float32 sigmas of a rollout whose shared window starts at ``window_start``: the schedule,
        with the steps after the window compressed when ``sampler.ode_steps_after_window`` is set."""
        w = self.sde_window
        if window_start is None or not w.ode_steps_after:
            return self.sigmas
        return rollout_schedule(self.sigmas, window_start + w.size, w.ode_steps_after, self.sigma_spec)

    @property
    def components(self) -> int:
        """K, the component rewards per sample (0: one (B,) reward)."""
        return len(self.reward_weights) if self.reward_weights is not None else 0

    def total(self, rewards: torch.Tensor) -> torch.Tensor:
        """The reward the schedules and the logs see: ``rewards`` itself, or Σ_k w_k r_k of (..., K) components."""
        return rewards if self.reward_weights is None else weighted_sum(rewards, self.reward_weights)

    @property
    def num_steps(self) -> int:
        """T."""
        return self.sigmas.numel() - 1

    @property
    def steps_per_sample(self) -> int:
        """|S| (the same for every sample)."""
        sel = self.selection
        return num_selected(sel["method"], self.num_steps, sel["fraction"], sel.get("window_size", 0))

    @property
    def samples_per_update(self) -> int:
        """Samples of one update over all ranks."""
        return self.prompts_per_step // self.updates_per_rollout * self.group_size

    def update_of(self, slot: int) -> int:
        """Which optimizer step of the rollout trains prompt ``slot``."""
        return slot * self.updates_per_rollout // self.prompts_per_step

    def sync_mode(self) -> str:
        """Sync of this step's updates: Reweight always coalesces (it must scale before reducing); Native
        syncs per backward like the baselines and Retain once per update, unless ``sync`` says otherwise."""
        if self.schedule == "reweight":
            return "coalesced"
        if self.sync is not None:
            return self.sync
        return "per_backward" if self.schedule == "native" else "coalesced"

    def reweight_plan(self) -> ReweightPlan:
        """The exact accumulation Reweight uses for these settings."""
        plan = plan_reweight(self.reweight_accumulate, advantage=self.advantage, group_size=self.group_size,
                             prompts_per_step=self.prompts_per_step, adv_clip_max=self.adv_clip_max,
                             global_std=self.global_std,
                             aggregate="rewards" if self.reward_weights is None else "advantages")
        return dataclasses.replace(plan, provisional_dtype=self.provisional_dtype)

    def selection_varies(self, ctx: ParallelContext) -> bool:
        """Whether the data-parallel ranks train different steps in one round."""
        if self.sde_window.shared:
            return False
        return selection_varies_across_ranks(self.selection["method"], layout=self.layout,
                                             group_size=self.group_size, dp_size=ctx.dp_size)

    def gather_mode(self, ctx: ParallelContext) -> str:
        """How FSDP2 gathers the parameters in a step: forward, rollout or step
        (:mod:`leangrpo_mcore.parallel.gathering`)."""
        return gather_mode(self.reshard_after_forward, schedule=self.schedule, varies=self.selection_varies(ctx),
                           experts=self.experts is not None)

    def _check_experts(self, ctx: ParallelContext) -> None:
        """Two experts: some selected step must run a trained expert, and when the data-parallel ranks train
        different steps (so that one rank's update may run one expert while another's runs the other), no
        collective may depend on which expert a rank runs (:func:`~leangrpo_mcore.parallel.gathering.gather_mode`)."""
        sel, experts = self.selection, self.experts
        candidates = torch.zeros(self.num_steps, dtype=torch.bool)
        if sel["method"] == "flow_grpo":
            candidates[:num_selected("flow_grpo", self.num_steps, sel["fraction"])] = True
        else:
            candidates[:-1] = True
        if not bool((experts.trained(self.sigmas) & candidates).any()):
            raise ValueError(f"model.experts.train={experts.train}: no step that grpo.timestep_selection="
                             f"{sel['method']} may select runs the {experts.train}-noise expert")
        if ctx.dp_size == 1 or not self.selection_varies(ctx):
            return
        if self.updates_per_rollout > 1:
            raise ValueError(f"with two experts and {sel['method']} selection the data-parallel ranks may run "
                             "different experts in an update: a later update's recompute would gather them apart; "
                             "set grpo.updates_per_rollout=1")
        why = (f"with two experts and {sel['method']} selection the data-parallel ranks may run different experts "
               "in an update")
        if self.gather_mode(ctx) != "step" and not (self.schedule == "reweight" and self.gather_mode(ctx) == "rollout"):
            raise ValueError(f"{why}: their FSDP2 gathers would pair different experts' blocks; set "
                             "parallel.reshard_after_forward=false (or auto)")
        if self.sync_mode() == "per_backward":
            raise ValueError(f"{why}: their per-backward reduce-scatters would pair different experts' gradients; "
                             "set schedule.coalesce_sync=true")

    def schedule_options(self, name: str) -> dict:
        """Constructor options of schedule ``name``."""
        return {"plan": self.reweight_plan()} if name == "reweight" else {}

    def validate(self, ctx: ParallelContext, policy: torch.nn.Module) -> None:
        """One-line ValueError for settings that are inconsistent or could not be computed exactly."""
        sel = self.selection
        if self.sync not in (None, "per_backward", "coalesced"):
            raise ValueError(f"unknown gradient sync {self.sync!r}; valid: per_backward, coalesced")
        if self.schedule == "auto":
            raise ValueError("schedule 'auto' must be resolved by the planner before building the step engine")
        if (sel["method"] == "sde_window") != (sel.get("window_size", 0) > 0):
            raise ValueError("sampler.sde_window_size > 0 goes with grpo.timestep_selection=sde_window (and only)")
        check_selection(sel["method"], self.num_steps, sel["fraction"], sel.get("window_size", 0),
                        sel.get("window_range", (0, 1)))
        window = self.sde_window
        window.check(self.num_steps, self.ode_solver, self.ode_before_window)
        if is_ratio(window.ode_steps_after) and self.sigma_spec is None:
            raise ValueError("sampler.ode_steps_after_window as a ratio re-spaces the schedule after the window: the "
                             "plan needs the schedule's formula (sigma_spec)")
        if is_ratio(window.ode_steps_after) and self.sigma_spec.kind == "qwen_image":
            raise ValueError("sampler.ode_steps_after_window as a ratio re-spaces the schedule on its time grid; the "
                             "qwen_image schedule is stretched to its terminal sigma and has none: give a count")
        bounds = sel.get("window_range", (0, 1))
        if (window.size, window.low, window.high) != (sel.get("window_size", 0), int(bounds[0]), int(bounds[-1])):
            raise ValueError("the plan's window and its selection disagree on the window's size or range")
        check_layout(self.layout, ctx.dp_size, self.group_size, self.prompts_per_step)
        if ctx.layout.cp > 1 and self.async_scoring:
            raise ValueError("reward.async_scoring with parallel.cp > 1 is not supported yet: set one of them off")
        if ctx.layout.pp > 1 and self.async_scoring:
            raise ValueError("reward.async_scoring with parallel.pp > 1 is not supported yet: set one of them off")
        if (self.schedule == "reweight" and self.gather_mode(ctx) == "forward" and int(ctx.layout.dp_shard) > 1
                and self.selection_varies(ctx)):
            raise ValueError(f"Reweight with {sel['method']} selection trains different steps on different ranks: "
                             "its immediate backwards cannot regather FSDP2 blocks in step; set "
                             "parallel.reshard_after_forward=false, rollout or auto")
        if self.experts is not None:
            self._check_experts(ctx)
        if sel["method"] == "dance_grpo" and self.micro_batch > 1:
            raise ValueError("dance_grpo selection trains different steps per sample: use schedule.micro_batch=1")
        if self.prompts_per_step % self.updates_per_rollout:
            raise ValueError(f"grpo.updates_per_rollout ({self.updates_per_rollout}) must divide "
                             f"grpo.prompts_per_step ({self.prompts_per_step}): each update trains whole groups")
        check_updates(self.layout, ctx.dp_size, self.group_size, self.prompts_per_step, self.updates_per_rollout)
        if self.reward_weights is not None and (not self.reward_weights
                                                or not all(math.isfinite(w) for w in self.reward_weights)):
            raise ValueError(f"reward.aggregate=advantages needs finite reward weights, got {self.reward_weights}")
        if self.advantage == "dance_grpo" and self.group_size < 2:
            raise ValueError("dance_grpo advantages use an unbiased std: grpo.group_size must be >= 2")
        if self.objective.kl_beta > 0:
            from leangrpo_mcore.models.common.lora import iter_lora_hosts

            if next(iter_lora_hosts(policy), None) is None:
                raise ValueError("grpo.kl_beta > 0 needs LoRA: the KL reference is the policy with its adapters "
                                 "disabled (set model.lora.rank > 0)")
