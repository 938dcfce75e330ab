"""Wan2.2-A14B's two experts: the policy's ODE rollout equals diffusers' ``WanPipeline`` with ``transformer_2`` and
``boundary_ratio`` (tiny, fp32, same noise and text embeddings, Euler), switching experts at the step diffusers
switches; a pipeline root converts both ways bit-exactly and its export loads in diffusers."""

import json

import pytest

from tests.once import once_per_process
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.diffusion.sampler import SDEParams, rollout
from leangrpo_mcore.diffusion.selection import ExpertSteps
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import WanVelocity
from leangrpo_mcore.models import build_policy, load_policy
from leangrpo_mcore.models.wan import PRESETS, WanConfig, WanExperts
from leangrpo_mcore.models.wan.experts import boundary_timestep

pytestmark = pytest.mark.slow

BOUNDARY, SHIFT, STEPS, CFG = 0.875, 5.0, 6, 4.0


def _diffusers_expert(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**PRESETS["tiny"]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
@once_per_process
def pipeline_root(tmp_path_factory):
    """(diffusers pipeline with two random experts, its saved root, a work dir)."""
    root = tmp_path_factory.mktemp("a14b")
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), transformer=_diffusers_expert(1),
                       transformer_2=_diffusers_expert(2), boundary_ratio=BOUNDARY)
    pipe.save_pretrained(str(root / "pipe"))
    return pipe, root


@pytest.fixture(scope="module")
@once_per_process
def policy(pipeline_root):
    return load_policy(pipeline_root[1] / "pipe", backend="local")


def _inputs():
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(2, 4, 2, 8, 6, generator=gen)  # 5 frames of 64x48 pixels
    text, negative = torch.randn(2, 7, 16, generator=gen), torch.randn(2, 7, 16, generator=gen)
    return latents, text, negative


def _count_calls(modules: dict[str, torch.nn.Module]) -> tuple[list[str], list]:
    seen, handles = [], []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: seen.append(name)))
    return seen, handles


def test_rollout_equals_wan_pipeline_with_two_experts(pipeline_root, policy):
    pipe, _ = pipeline_root
    assert isinstance(policy, WanExperts) and policy.config.boundary_ratio == BOUNDARY
    latents, text, negative = _inputs()
    theirs, handles = _count_calls({"high": pipe.transformer, "low": pipe.transformer_2})
    with torch.no_grad():
        expected = pipe(prompt_embeds=text, negative_prompt_embeds=negative, latents=latents.clone(), height=64,
                        width=48, num_frames=5, num_inference_steps=STEPS, guidance_scale=CFG,
                        output_type="latent").frames
    for h in handles:
        h.remove()
    sigmas = get_sigmas("wan", STEPS, shift=SHIFT)
    velocity = WanVelocity(policy, sigma_kind="wan", cfg_scale=CFG)
    ours, handles = _count_calls({"high": policy.high, "low": policy.low})
    none = torch.zeros(2, STEPS, dtype=torch.bool)
    traj = rollout(velocity, latents, sigmas, Conditioning(encoder_hidden_states=text,
                                                           negative_encoder_hidden_states=negative),
                   sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), selected=none, sde_steps=none,
                   noise_seeds=torch.zeros(2, STEPS, dtype=torch.long), prompt_ids=torch.arange(2),
                   generation_ids=torch.zeros(2, dtype=torch.long))
    for h in handles:
        h.remove()
    # diffusers runs cond and uncond as two forwards, ours one batch of both: one call per step here
    assert theirs[::2] == theirs[1::2] == ours
    switch = ours.index("low")
    assert 0 < switch < STEPS and ours == ["high"] * switch + ["low"] * (STEPS - switch)
    # the steps the engine trains for each experts.train are the ones the policy routes to that expert
    routed = [name == "high" for name in ours]
    steps = {train: ExpertSteps(boundary_timestep(BOUNDARY), "wan", train).trained(sigmas).tolist()
             for train in ("both", "high", "low")}
    assert steps == {"both": [True] * STEPS, "high": routed, "low": [not r for r in routed]}
    assert pipe.scheduler.timesteps[switch - 1] >= BOUNDARY * 1000 > pipe.scheduler.timesteps[switch]
    err = (traj.final_latents - expected).abs().max() / expected.abs().max()
    assert err <= 1e-5, err


def test_mixed_batch_runs_each_row_on_its_expert(pipeline_root, policy):
    pipe, _ = pipeline_root
    latents, text, _ = _inputs()
    timestep = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        out = policy(latents, timestep, text)
        high = pipe.transformer(latents[:1], timestep[:1], text[:1], return_dict=False)[0]
        low = pipe.transformer_2(latents[1:], timestep[1:], text[1:], return_dict=False)[0]
        swapped = policy(latents.flip(0), timestep.flip(0), text.flip(0))
    assert ((out[:1] - high).abs().max() / high.abs().max()) <= 1e-5
    assert ((out[1:] - low).abs().max() / low.abs().max()) <= 1e-5
    assert torch.equal(swapped.flip(0), out)


def test_conversion_round_trip_is_bit_exact_and_loads_in_diffusers(pipeline_root):
    pipe, root = pipeline_root
    ours, back = root / "ours", root / "export"
    assert convert_main(["diffusers-to-mcore", "--model", "wan", "--src", str(root / "pipe"), "--dst", str(ours)]) == 0
    meta = json.loads((ours / "leangrpo_model.json").read_text())
    assert meta["config"]["boundary_ratio"] == BOUNDARY
    assert convert_main(["mcore-to-diffusers", "--src", str(ours), "--dst", str(back)]) == 0
    index = json.loads((back / "model_index.json").read_text())
    assert index["boundary_ratio"] == BOUNDARY and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    for component, original in (("transformer", pipe.transformer), ("transformer_2", pipe.transformer_2)):
        loaded = WanTransformer3DModel.from_pretrained(str(back / component)).state_dict()
        assert sorted(loaded) == sorted(original.state_dict())
        assert all(torch.equal(loaded[k], v) for k, v in original.state_dict().items())
    reloaded = load_policy(back, backend="local")
    direct = load_policy(ours, backend="local")
    mine = dict(direct.named_parameters())
    assert all(torch.equal(p, mine[name]) for name, p in reloaded.named_parameters())


def test_experts_share_config_and_are_built_apart():
    policy = build_policy({"family": "wan", "preset": "wan-tiny-a14b"}, seed=3, backend="local")
    assert policy.high.config is policy.low.config is policy.config
    assert len(policy.blocks()) == 4 and policy.fsdp_groups() == [policy.high, policy.low]
    high, low = dict(policy.high.named_parameters()), dict(policy.low.named_parameters())
    assert sorted(high) == sorted(low) and not torch.equal(high["layers.0.ffn.fc1.weight"],
                                                          low["layers.0.ffn.fc1.weight"])
    assert policy.num_parameters() == 2 * 19640
    with torch.device("meta"):
        full = WanExperts(WanConfig.from_diffusers_config(PRESETS["wan2.2-t2v-a14b"]), backend="local")
    assert full.num_parameters() == 2 * 14_288_491_584
