"""Native / Retain / Reweight gradient parity on tiny FLUX and Wan policies (world size 1, fp32, CPU).

Retain must be bitwise equal to Native (gradients of every update and parameters after the SGD steps), Reweight
within a relative L2 tolerance set per case at least 3x above its measured fp32 error (Reweight scales already
formed gradients, so it differs from Native by rounding alone: 2e-7 to 9e-7 measured single-threaded on CPU; the
default 1e-6 stands where the error is at most 3.3e-7); all three must draw the same trajectories and rewards
(bitwise; with micro-batches of B > 1 Reweight's trained steps run per-sample forwards of batch 1, whose float
rounding differs from a batch of B, so there its trajectory is the same up to rounding). The values of the KL term
and of the loss weighting are pinned against a formula in ``test_native_closed_form.py``. The helpers here
(:class:`Case`, :func:`run_case`) are shared with the distributed tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.selection import ExpertSteps
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import FluxVelocity, QwenImageVelocity, SD3Velocity, WanVelocity
from leangrpo_mcore.diffusion.window import SDEWindow
from leangrpo_mcore.engine import StepEngine, StepInputs, StepPlan
from leangrpo_mcore.parallel.fsdp import apply_fsdp
from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context
from leangrpo_mcore.schedules import Objective

FLUX_GRID = 8  # VAE latent grid of the tiny FLUX case: 16 packed tokens of 4·4 channels


@dataclass(frozen=True)
class Case:
    """One training-step configuration on a tiny policy."""

    family: str = "flux"
    schedule: str = "native"
    lora: bool = False
    kl_beta: float = 0.0
    kl_form: str = "flow_grpo"
    selection: str = "flow_grpo"
    fraction: float = 0.99
    window: int = 0
    sde_kind: Optional[str] = None
    advantage: str = "flow_grpo"
    global_std: bool = False
    adv_clip_max: float = 5.0
    group_size: int = 4
    prompts: int = 2
    micro_batch: int = 1
    updates: int = 1
    layout: str = "shared"
    sync: Optional[str] = None
    accumulate: str = "per_sample"
    num_steps: int = 4
    tp: int = 1
    cp: int = 1
    """parallel.cp: the tokens of each sample split over cp ranks."""
    pp: int = 1
    """parallel.pp: the blocks split over pp pipeline stages (one per rank of a sample)."""
    heads: Optional[int] = None
    """Attention heads of the tiny policy (None: the preset's 2); tp x cp must divide them."""
    reshard: Optional[bool] = None
    """parallel.reshard_after_forward (False: parameters stay gathered until the optimizer step; None: auto)."""
    async_scoring: bool = False
    """reward.async_scoring: each group scored in the background during the next group's rollout."""
    reward_weights: Optional[tuple[float, ...]] = None
    """reward.aggregate=advantages: the weights of the (B, K) component rewards the reward function returns."""
    window_schedule: str = "random"
    """sampler.sde_window_schedule (with selection sde_window)."""
    window_range: tuple[int, int] = (0, 2)
    """sampler.sde_window_range."""
    ode_solver: str = "euler"
    """sampler.ode_solver: the ODE steps outside the SDE window."""
    ode_after: int = 0
    """sampler.ode_steps_after_window (0: no compression)."""
    step: int = 5
    """The training step number (seeds; a progressive window's position)."""
    ratio_norm: bool = False
    """grpo.ratio_norm (GRPO-Guard's RatioNorm)."""
    grad_reweight: str = "none"
    """grpo.grad_reweight (GRPO-Guard's per-step weight: none, flow_grpo, dancegrpo)."""
    reference: bool = False
    """A conditioning image per prompt (FLUX.1-Kontext: its tokens beside the generated ones in every forward)."""
    experts: Optional[str] = None
    """Wan only: a two-expert policy (the tiny Wan2.2-A14B, boundary 0.875) training ``both``, ``high`` or ``low``."""
    max_grad_norm: float = 1.0
    """optim.max_grad_norm (0: no clipping, the optimizer sees the reduced gradients themselves)."""
    image: Optional[str] = None
    """Wan only, image-to-video: ``concat`` (the tiny Wan2.1-I2V: mask and image latents beside the noisy ones,
    CLIP tokens; two experts with ``experts``: Wan2.2-I2V-A14B) or ``first_frame`` (Wan2.2-TI2V's)."""

    def but(self, **changes) -> "Case":
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


@dataclass
class Outcome:
    """What a step produced, as numpy arrays (picklable across ranks)."""

    grads: list[list[np.ndarray]]
    """Per update, the full gradient of every trainable parameter as the optimizer saw it."""
    names: list[str]
    """The trainable parameters' names (this rank's pipeline stage: a subset of the whole model's)."""
    params: list[np.ndarray]
    """Trainable parameters after all optimizer steps (full tensors)."""
    rewards: np.ndarray
    """(P, M) rewards of the step."""
    trajectory: np.ndarray
    """This rank's x_t, x_{t+1} and log-probs, flattened in slot and micro-batch order."""
    ratio: list[tuple[float, float]]
    """(min, max) ratio of each update."""
    buffers: int
    """Most provisional gradients held at once (first update)."""
    grad_norms: list[float]
    """Global gradient norm of each update (before clipping)."""
    losses: list[float]
    """Loss of each update (summed over ranks)."""
    advantages: Optional[np.ndarray] = None
    """(P, M) clamped advantages of the step."""
    components: Optional[np.ndarray] = None
    """(P, M, K) component rewards (reward.aggregate=advantages), else None."""
    frozen: Optional[dict[str, np.ndarray]] = None
    """The frozen parameters after all optimizer steps (full tensors), by name."""


class RecordingSGD(torch.optim.SGD):
    """SGD that records the full gradient it is given at every step (zeros for a parameter given none: Qwen-Image's
    idle text MLP of the last block)."""

    recorded: list

    def step(self, closure=None):
        grads = [_full(torch.zeros_like(p) if p.grad is None else p.grad, p)
                 for group in self.param_groups for p in group["params"]]
        self.recorded = getattr(self, "recorded", []) + [grads]
        return super().step(closure)


def _reward(final: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """A deterministic reward with spread: a fixed linear read-out of the final latents."""
    weights = torch.linspace(-1.0, 1.0, final[0].numel())
    return (final.flatten(1) * weights).sum(1) + 0.1 * prompt_ids.to(torch.float32)


def _setup(case: Case, pp_rank: int = 0):
    """(policy, velocity fn, latent shape, sigmas, sde kind, noise level, conditioning); at ``case.pp`` > 1 the
    policy is stage ``pp_rank`` of the whole one, with the whole one's values."""
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, mark_only_lora_trainable
    from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

    heads = {} if case.heads is None else {"num_attention_heads": case.heads}
    preset = _preset(case)
    policy = build_policy({"family": case.family, "preset": preset, **heads}, seed=0, backend="local")
    if case.lora:
        apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, targets=("to_q", "to_v")), seed=0)
        mark_only_lora_trainable(policy)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # B starts at 0 (policy == reference); perturb it so the KL term is live
            for name, param in policy.named_parameters():
                if "lora_B" in name:  # drawn at full size, then sliced: the same adapters at every TP size
                    param.copy_(shard_tensor(0.3 * torch.randn(full_shape(param), generator=gen), param))
    if case.experts not in (None, "both"):
        from leangrpo_mcore.engine.build import freeze_experts

        freeze_experts(policy, case.experts)
    if case.pp > 1:
        policy = _stage_of(policy, case, pp_rank)
    gen = torch.Generator().manual_seed(11)
    p = case.prompts
    if case.family == "flux":
        velocity = FluxVelocity(policy, latent_height=FLUX_GRID, latent_width=FLUX_GRID)
        shape, kind, noise = (16, 16), case.sde_kind or "flow_grpo", 0.9
        cond = Conditioning(encoder_hidden_states=torch.randn(p, 5, 32, generator=gen),
                            pooled_projections=torch.randn(p, 24, generator=gen), guidance=torch.full((p,), 3.5))
        if case.reference:
            cond = dataclasses.replace(cond, reference_latents=torch.randn(p, *shape, generator=gen))
    elif case.family == "sd3":
        # CFG 4.5 with a negative prompt's tokens and pooled vector, as FlowGRPO's SD3.5-M runs
        velocity = SD3Velocity(policy, cfg_scale=4.5)
        shape, kind, noise = (16, 8, 8), case.sde_kind or "flow_grpo", 0.7
        cond = Conditioning(encoder_hidden_states=torch.randn(p, 5, 24, generator=gen),
                            pooled_projections=torch.randn(p, 20, generator=gen),
                            negative_encoder_hidden_states=torch.randn(p, 5, 24, generator=gen),
                            negative_pooled_projections=torch.randn(p, 20, generator=gen))
    elif case.family == "qwen_image":
        # true CFG 4 against a negative prompt; prompts of 6 and 4 real tokens, the negative of 2: padding masked
        velocity = QwenImageVelocity(policy, latent_height=FLUX_GRID, latent_width=FLUX_GRID, cfg_scale=4.0)
        shape, kind, noise = (16, 64), case.sde_kind or "flow_grpo", 1.2
        real = torch.arange(6)[None, :] < torch.tensor([[6], [4]] * p)[:p]
        cond = Conditioning(encoder_hidden_states=torch.randn(p, 6, 24, generator=gen) * real[..., None],
                            negative_encoder_hidden_states=torch.randn(p, 6, 24, generator=gen),
                            encoder_attention_mask=real,
                            negative_encoder_attention_mask=(torch.arange(6) < 2).expand(p, 6).clone())
    else:
        velocity = WanVelocity(policy, cfg_scale=4.0, first_frame=case.image == "first_frame")
        shape, kind, noise = (4, 1, 4, 4), case.sde_kind or "wan", 0.7
        cond = _wan_conditioning(case, p, gen)
    if kind == "dance_grpo":
        sigmas, noise = get_sigmas("dance", case.num_steps, shift=3.0), 0.3
    elif case.family == "flux":
        sigmas = get_sigmas("flux", case.num_steps, image_seq_len=16)
    elif case.family == "sd3":
        sigmas = get_sigmas("sd3", case.num_steps, shift=3.0)
    elif case.family == "qwen_image":
        sigmas = get_sigmas("qwen_image", case.num_steps, image_seq_len=16)
    else:
        sigmas = get_sigmas("wan", case.num_steps, shift=3.0)
    return policy, velocity, shape, sigmas, kind, noise, cond


def _preset(case: Case) -> str:
    """The tiny preset of ``case``: one transformer or two experts, text- or image-to-video."""
    if case.image == "concat":
        return "wan-tiny-i2v-a14b" if case.experts else "wan-tiny-i2v"
    return "wan-tiny-a14b" if case.experts else "tiny"


def _wan_conditioning(case: Case, p: int, gen: torch.Generator) -> Conditioning:
    """Text and negative text, and the image's conditioning fields of an image-to-video ``case``."""
    image = {}
    if case.image == "concat":  # 4 mask + 4 image-latent channels; CLIP tokens for the one-expert checkpoint
        mask = torch.zeros(p, 4, 1, 4, 4)
        mask[:, :, 0] = 1.0
        image["reference_latents"] = torch.cat([mask, torch.randn(p, 4, 1, 4, 4, generator=gen)], dim=1)
        if not case.experts:
            image["image_embeds"] = torch.randn(p, 7, 20, generator=gen)
    elif case.image == "first_frame":
        image["reference_latents"] = torch.randn(p, 4, 1, 4, 4, generator=gen)
    return Conditioning(encoder_hidden_states=torch.randn(p, 5, 16, generator=gen),
                        negative_encoder_hidden_states=torch.randn(p, 5, 16, generator=gen), **image)


def _stage_of(whole: torch.nn.Module, case: Case, pp_rank: int) -> torch.nn.Module:
    """Pipeline stage ``pp_rank`` of ``whole`` (same values, same names, same trainable parameters)."""
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, mark_only_lora_trainable
    from leangrpo_mcore.models.common.pipeline import split_blocks

    heads = {} if case.heads is None else {"num_attention_heads": case.heads}
    stage = split_blocks(whole.config.num_layers, case.pp)[pp_rank]
    preset = _preset(case)
    policy = build_policy({"family": case.family, "preset": preset, **heads}, seed=0, backend="local", stage=stage)
    if case.lora:
        apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, targets=("to_q", "to_v")), seed=0, require_match=False)
        mark_only_lora_trainable(policy)
    values = whole.state_dict()
    policy.load_state_dict({name: values[name] for name in policy.state_dict()}, strict=True)
    if case.experts not in (None, "both"):
        from leangrpo_mcore.engine.build import freeze_experts

        freeze_experts(policy, case.experts)
    return policy


def _full(t: torch.Tensor, param: torch.nn.Parameter) -> np.ndarray:
    """The whole tensor: FSDP shards all-gathered (``full_tensor``), then tensor-parallel pieces."""
    from leangrpo_mcore.models.common.tp import gather_tensor

    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return gather_tensor(whole, param).detach().clone().numpy()


def run_case(case: Case, reward_fn=None) -> Outcome:
    """Build the tiny policy (FSDP2 over the data-parallel ranks when distributed) and run one step."""
    ctx = build_parallel_context(Layout(tp=case.tp, cp=case.cp, pp=case.pp))
    policy, velocity, shape, sigmas, kind, noise, cond = _setup(case, ctx.pp_rank)
    apply_fsdp(policy, ctx)
    if case.pp > 1:
        from leangrpo_mcore.parallel.stages import StagedVelocity, StageLink

        velocity = StagedVelocity(velocity, StageLink(ctx, torch.float32))
    plan = StepPlan(
        schedule=case.schedule, group_size=case.group_size, prompts_per_step=case.prompts, latent_shape=shape,
        sigmas=sigmas, sde=SDEParams.from_sigmas(kind, noise, sigmas),
        objective=Objective(clip_range=1e-4, kl_beta=case.kl_beta, kl_form=case.kl_form, ratio_norm=case.ratio_norm,
                            grad_reweight=case.grad_reweight),
        selection={"method": case.selection, "fraction": case.fraction, "window_size": case.window,
                   "window_range": case.window_range},
        advantage=case.advantage, adv_clip_max=case.adv_clip_max, global_std=case.global_std, layout=case.layout,
        micro_batch=case.micro_batch, updates_per_rollout=case.updates, sync=case.sync,
        reweight_accumulate=case.accumulate, max_grad_norm=case.max_grad_norm, seed=3,
        reshard_after_forward=case.reshard,
        async_scoring=case.async_scoring, reward_weights=case.reward_weights,
        window=SDEWindow(size=case.window, low=case.window_range[0], high=case.window_range[1],
                         schedule=case.window_schedule, ode_steps_after=case.ode_after),
        ode_solver=case.ode_solver,
        # the velocity function's timestep convention (WanVelocity's default: sigma x 1000)
        experts=None if case.experts is None else ExpertSteps(875.0, "wan", case.experts),
    )
    named = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = RecordingSGD(params, lr=0.5)
    engine = StepEngine(plan, policy=policy, velocity_fn=velocity, ctx=ctx, optimizer=optimizer,
                        reward_fn=reward_fn or _reward, keep_trajectories=True)
    result = engine.step(StepInputs(step=case.step, conditioning=cond, prompt_ids=torch.arange(case.prompts)))
    pieces = [torch.cat([t.latents.flatten(), t.next_latents.flatten(), t.log_probs.flatten()])
              for slot in sorted(result.trajectories) for t in result.trajectories[slot]]
    return Outcome(grads=optimizer.recorded, names=[name for name, _ in named], params=[_full(p, p) for p in params],
                   rewards=result.rewards.numpy(),
                   trajectory=torch.cat(pieces).numpy(), ratio=[(u.ratio_min, u.ratio_max) for u in result.updates],
                   buffers=result.updates[0].max_local_grad_buffers,
                   grad_norms=[u.grad_norm for u in result.updates], losses=[u.loss for u in result.updates],
                   advantages=result.advantages.numpy(),
                   components=None if result.component_rewards is None else result.component_rewards.numpy(),
                   frozen={name: _full(p, p) for name, p in policy.named_parameters() if not p.requires_grad})


def rel_l2(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Relative L2 distance of two lists of arrays (float64)."""
    num = sum(float(((x.astype(np.float64) - y) ** 2).sum()) for x, y in zip(a, b))
    den = sum(float((x.astype(np.float64) ** 2).sum()) for x in a)
    return (num / den) ** 0.5


def bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Same shapes and identical bits everywhere."""
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def check_parity(native: Outcome, retain: Outcome, reweight: Outcome, *, per_sample: bool = False,
                 tol: float = 1e-6) -> None:
    """The schedule-equivalence assertions for one configuration (``per_sample``: Reweight's trained steps ran
    per-sample forwards in micro-batches of B > 1, so its rollout equals Native's up to float rounding; ``tol``:
    the relative L2 limit of Reweight against Native, at least 3x the case's measured fp32 error)."""
    assert np.array_equal(native.rewards, retain.rewards)
    assert np.array_equal(native.trajectory, retain.trajectory)
    if per_sample:
        np.testing.assert_allclose(reweight.rewards, native.rewards, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(reweight.trajectory, native.trajectory, rtol=1e-5, atol=1e-5)
    else:
        assert np.array_equal(native.rewards, reweight.rewards)
        assert np.array_equal(native.trajectory, reweight.trajectory)
    assert len(native.grads) == len(retain.grads) == len(reweight.grads)
    for n, r, w in zip(native.grads, retain.grads, reweight.grads):
        assert max(float(np.abs(g).max()) for g in n) > 0
        assert bitwise(n, r)
        assert rel_l2(n, w) < tol
    assert bitwise(native.params, retain.params)
    assert rel_l2(native.params, reweight.params) < tol
    low, high = native.ratio[0]
    assert abs(low - 1.0) <= 1e-6 and abs(high - 1.0) <= 1e-6  # on-policy: the recompute reproduces log p_old
    assert retain.ratio[0] == reweight.ratio[0] == (1.0, 1.0)
    assert native.losses == retain.losses
    assert all(math.isclose(n, w, rel_tol=1e-5, abs_tol=1e-7) for n, w in zip(native.losses, reweight.losses))


def run_three(case: Case) -> tuple[Outcome, Outcome, Outcome]:
    """Native, Retain and Reweight on ``case``."""
    return tuple(run_case(case.but(schedule=name)) for name in ("native", "retain", "reweight"))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def test_flux_full_finetune_guidance_embedding():
    native, retain, reweight = run_three(Case(family="flux"))
    check_parity(native, retain, reweight)
    affine = run_case(Case(family="flux", schedule="reweight", accumulate="affine"))
    assert rel_l2(native.grads[0], affine.grads[0]) < 1e-6
    assert reweight.buffers == 4  # one provisional gradient per in-flight sample (the 4 generations of a prompt)


def test_wan_cfg_lora_kl_dance_selection_two_updates():
    case = Case(family="wan", lora=True, kl_beta=20.0, kl_form="exact", selection="dance_grpo", fraction=0.7,
                advantage="dance_grpo", sde_kind="dance_grpo", updates=2, group_size=3)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, tol=3e-6)  # measured 6.1e-7 (second update)
    without_kl = run_case(case.but(kl_beta=0.0))
    assert rel_l2(native.grads[0], without_kl.grads[0]) > 1e-2  # the KL term is a real part of the gradient


def test_flux_lora_kl_global_std_sde_window_micro_batch():
    case = Case(family="flux", lora=True, kl_beta=50.0, selection="sde_window", window=2, fraction=1.0,
                global_std=True, micro_batch=2)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, per_sample=True, tol=4e-6)  # measured 9.0e-7
    affine = run_case(case.but(schedule="reweight", accumulate="affine"))
    assert rel_l2(native.grads[0], affine.grads[0]) < 4e-6  # measured 9.1e-7


# FLUX.1-Kontext: every forward sees the prompt's reference tokens beside the generated ones (32 tokens, the second
# half with RoPE image index 1), and its velocity is the generated half's
KONTEXT = Case(family="flux", reference=True, lora=True, kl_beta=20.0)


def test_flux_kontext_reference_tokens_lora_kl_micro_batch():
    case = KONTEXT.but(micro_batch=2)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, per_sample=True, tol=2e-6)  # measured 5.5e-7
    plain = run_case(case.but(reference=False))
    assert rel_l2(native.grads[0], plain.grads[0]) > 1e-2  # the reference tokens are part of every forward


def test_sd3_cfg_dual_attention_lora_kl():
    case = Case(family="sd3", lora=True, kl_beta=10.0)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight)
    assert any("attn2.to_q.lora" in name for name in native.names)  # the MMDiT-X attention trains too


# MixGRPO-Flash: a progressive window (at step 5: start 1 of [0, 3)), DPM-Solver++(2M) outside it and the 3 steps
# after it compressed to 2 (the first of them second order), on both families
MIX_FLASH = Case(selection="sde_window", window=2, fraction=1.0, num_steps=6, window_schedule="progressive",
                 window_range=(0, 3), ode_solver="dpmpp_2m", ode_after=2)


@pytest.mark.parametrize("family, extra", [("flux", {}), ("wan", {"lora": True, "kl_beta": 20.0, "micro_batch": 2})])
def test_progressive_window_dpmpp_2m_compressed(family, extra):
    case = MIX_FLASH.but(family=family, **extra)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, per_sample=case.micro_batch > 1, tol=2e-6)  # measured 2.0e-7, 3.3e-7
    euler = run_case(case.but(schedule="native", ode_solver="euler"))
    assert native.trajectory.shape == euler.trajectory.shape  # 5 steps each: 1 + 2 window + 2 compressed
    assert float(np.abs(native.trajectory - euler.trajectory).max()) > 1e-4  # the second-order steps ran


# GRPO-Guard: RatioNorm and the step weights folded into the recompute-free losses (exact on the first update), and a
# second update (Native after the first optimizer step) where the ratio moves and the drift term acts
GUARD = Case(ratio_norm=True, grad_reweight="flow_grpo", updates=2)


@pytest.mark.parametrize("case", [GUARD, GUARD.but(family="wan", lora=True, kl_beta=20.0, sde_kind="dance_grpo",
                                                   grad_reweight="dancegrpo", micro_batch=2, group_size=4)],
                         ids=["flux_flow_grpo", "wan_dancegrpo_lora_kl_mb2"])
def test_grpo_guard(case):
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, per_sample=case.micro_batch > 1, tol=2e-6)  # measured 2.0e-7, 3.1e-7
    plain = run_case(case.but(schedule="native", ratio_norm=False, grad_reweight="none"))
    assert rel_l2(native.grads[0], plain.grads[0]) > 1e-3  # the guard changes the gradient (measured 4.8e-3 with KL)
    assert native.ratio[1] != (1.0, 1.0)  # the second update is off-policy


def test_qwen_image_true_cfg_masked_text_full_finetune():
    # The last block's idle text MLP holds parameters that never get a gradient (zero, as in diffusers' model).
    native, retain, reweight = run_three(Case(family="qwen_image"))
    check_parity(native, retain, reweight, tol=4e-6)  # measured 1.04e-6: true CFG's x4 and norm rescale
    idle = [g for name, g in zip(native.names, native.grads[0]) if name.startswith("transformer_blocks.1.txt_mlp")]
    assert len(idle) == 4 and all(not g.any() for g in idle)


@pytest.mark.slow
def test_qwen_image_lora_kl_sde_window():
    native, retain, reweight = run_three(Case(family="qwen_image", lora=True, kl_beta=10.0, selection="sde_window",
                                              window=2, window_range=(0, 2)))
    check_parity(native, retain, reweight, tol=4e-6)
    assert any("attn.to_v.lora" in name for name in native.names)


def test_wan_global_std_with_clamping():
    case = Case(family="wan", global_std=True, adv_clip_max=0.8, accumulate="affine")
    native, retain, reweight = run_three(case)
    centred = native.rewards - native.rewards.mean(axis=1, keepdims=True)
    assert (np.abs(centred) / (native.rewards.std() + 1e-4)).max() > 0.8  # the clamp fires
    check_parity(native, retain, reweight, tol=2e-6)  # measured 5.0e-7


def test_flux_group_clamp_falls_back_to_per_sample():
    case = Case(family="flux", adv_clip_max=0.9, accumulate="affine", micro_batch=2, prompts=1)
    native, retain, reweight = run_three(case)
    centred = native.rewards - native.rewards.mean(axis=1, keepdims=True)
    assert (np.abs(centred) / (native.rewards.std(axis=1, keepdims=True) + 1e-4)).max() > 0.9  # the clamp fires
    check_parity(native, retain, reweight, per_sample=True)
    assert reweight.buffers == 4  # the affine plan fell back: one buffer per sample of the group


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_reweight_micro_batches_train_every_sample_of_the_per_sample_forwards(micro_batch):
    """Wan with two-branch CFG and the KL term: each sample's forward runs alone with its own conditioning."""
    case = Case(family="wan", lora=True, kl_beta=20.0, micro_batch=micro_batch, prompts=1)
    native, retain, reweight = run_three(case)
    check_parity(native, retain, reweight, per_sample=True, tol=2e-6)  # measured 3.6e-7
    assert reweight.buffers == 5  # one provisional gradient per sample, whatever the micro-batch, + the KL one
    single = run_case(case.but(schedule="reweight", micro_batch=1))
    assert rel_l2(single.grads[0], reweight.grads[0]) < 1e-6


def test_only_reweight_asks_the_rollout_for_per_sample_forwards(monkeypatch):
    import leangrpo_mcore.engine.step.rollout as step

    asked, real = [], step.RolloutLoop
    monkeypatch.setattr(step, "RolloutLoop", lambda *a, **k: asked.append(k["per_sample_grad"]) or real(*a, **k))
    for schedule in ("native", "retain", "reweight"):
        asked.clear()
        run_case(Case(family="flux", micro_batch=2, prompts=1, schedule=schedule))
        assert asked == [schedule == "reweight"] * 2  # two micro-batches of the group of 4
