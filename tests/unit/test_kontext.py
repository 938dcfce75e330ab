"""FLUX.1-Kontext: the policy's rollout against diffusers' FluxKontextPipeline, its conversion, and the reference
tokens' plumbing (what the velocity hands the policy and what it keeps of the output)."""

import dataclasses

import pytest
import torch

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.data.reference import encode_references, reference_shapes
from leangrpo_mcore.data.vae import build_vae
from leangrpo_mcore.diffusion.sampler import SDEParams, rollout
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import FluxVelocity, flux_image_ids
from leangrpo_mcore.models import load_policy
from tests.unit.test_flux_model import make_diffusers_flux
from tests.once import once_per_process

HEIGHT, WIDTH, STEPS, GENERATIONS, TEXT = 32, 48, 4, 3, 7
GRID = (HEIGHT // 8, WIDTH // 8)  # the VAE latent grid; 2x2 packing gives 2 x 3 = 6 tokens of 16 channels


@pytest.fixture(scope="module")
@once_per_process
def kontext(tmp_path_factory):
    """A tiny random FLUX transformer and VAE saved by diffusers, our policy converted from the former."""
    root = tmp_path_factory.mktemp("kontext")
    reference = make_diffusers_flux(root / "transformer", seed=3)
    build_vae("tiny", "flux", latent_channels=4, spatial_factor=8, seed=5).vae.save_pretrained(str(root / "vae"))
    assert convert_main(["diffusers-to-mcore", "--model", "flux", "--src", str(root / "transformer"),
                         "--dst", str(root / "ours")]) == 0
    return root, reference


def _source_image() -> torch.Tensor:
    """A smooth (1, 3, H, W) picture in [0, 1] with an edge, so that the VAE sees structure."""
    rows, cols = torch.meshgrid(torch.linspace(0, 1, HEIGHT), torch.linspace(0, 1, WIDTH), indexing="ij")
    image = torch.stack([rows, cols, 0.5 + 0.4 * torch.sin(6 * rows * cols)])
    image[:, 8:20, 10:30] = 0.9
    return image.unsqueeze(0)


@pytest.mark.slow
def test_rollout_equals_diffusers_flux_kontext_pipeline(kontext):
    """The same noise, text embeddings and source image through FluxKontextPipeline's Euler sampler (ODE) and
    through our policy's rollout: equal final latents to fp32 rounding (the source image encoded by each side)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    root, transformer = kontext
    vae = AutoencoderKL.from_pretrained(str(root / "vae"))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxKontextPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
                               tokenizer_2=None, transformer=transformer)
    gen = torch.Generator().manual_seed(11)
    tokens = GRID[0] // 2 * (GRID[1] // 2)
    noise = torch.randn(GENERATIONS, tokens, 16, generator=gen)
    text, pooled = torch.randn(1, TEXT, 32, generator=gen), torch.randn(1, 24, generator=gen)
    image = _source_image()
    with torch.no_grad():
        expected = pipe(image=image, prompt_embeds=text, pooled_prompt_embeds=pooled, height=HEIGHT, width=WIDTH,
                        max_area=HEIGHT * WIDTH, _auto_resize=False, num_inference_steps=STEPS, guidance_scale=3.5,
                        num_images_per_prompt=GENERATIONS, latents=noise.clone(), output_type="latent").images
    decoder = build_vae("diffusers", "flux", root / "vae", latent_channels=4, spatial_factor=8)
    policy = load_policy(root / "ours", backend="local")
    fields = encode_references("flux", decoder, image)
    assert fields["reference_latents"].shape == (1, tokens, 16)
    cond = Conditioning(encoder_hidden_states=text, pooled_projections=pooled, guidance=torch.tensor([3.5]),
                        **fields).select([0] * GENERATIONS)
    sigmas = get_sigmas("flux", STEPS, image_seq_len=tokens)
    off = torch.zeros(GENERATIONS, STEPS, dtype=torch.bool)
    with torch.no_grad():
        traj = rollout(FluxVelocity(policy, latent_height=GRID[0], latent_width=GRID[1]), noise, sigmas, cond,
                       sde=SDEParams.from_sigmas("flow_grpo", 0.0, sigmas), selected=off, sde_steps=off,
                       noise_seeds=torch.zeros(GENERATIONS, STEPS, dtype=torch.long),
                       prompt_ids=torch.zeros(GENERATIONS, dtype=torch.long),
                       generation_ids=torch.arange(GENERATIONS))
    assert expected.shape == traj.final_latents.shape == (GENERATIONS, tokens, 16)
    moved = (expected - noise).norm()
    assert moved > 0.5  # the sampler went somewhere: the comparison below is not of the initial noise
    assert ((traj.final_latents - expected).norm() / moved).item() < 1e-5
    # the reference matters: without it (plain FLUX) the same rollout lands elsewhere
    with torch.no_grad():
        plain = rollout(FluxVelocity(policy, latent_height=GRID[0], latent_width=GRID[1]), noise, sigmas,
                        dataclasses.replace(cond, reference_latents=None), sde=SDEParams.from_sigmas(
                            "flow_grpo", 0.0, sigmas), selected=off, sde_steps=off,
                        noise_seeds=torch.zeros(GENERATIONS, STEPS, dtype=torch.long),
                        prompt_ids=torch.zeros(GENERATIONS, dtype=torch.long), generation_ids=torch.arange(GENERATIONS))
    assert ((plain.final_latents - expected).norm() / moved).item() > 1e-3


def test_conversion_round_trips_bit_exactly(kontext, tmp_path):
    root, transformer = kontext
    assert convert_main(["mcore-to-diffusers", "--src", str(root / "ours"), "--dst", str(tmp_path / "back")]) == 0
    from safetensors.torch import load_file

    back = {}
    for path in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(str(path)))
    original = transformer.state_dict()
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], original[name]) for name in original)


class _Echo(torch.nn.Module):
    """A policy that records its inputs and returns its input tokens plus one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.calls: list[dict] = []

    def forward(self, **inputs):
        self.calls.append(inputs)
        return inputs["hidden_states"] + 1.0


def test_velocity_appends_reference_tokens_and_keeps_the_generated_ones():
    policy = _Echo()
    velocity = FluxVelocity(policy, latent_height=4, latent_width=6)
    latents, reference = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    cond = Conditioning(encoder_hidden_states=torch.ones(2, 3, 5), pooled_projections=torch.zeros(2, 7),
                        guidance=torch.full((2,), 3.5), reference_latents=reference)
    out = velocity(latents, torch.tensor([1.0, 0.5]), cond)
    call = policy.calls[-1]
    assert torch.equal(call["hidden_states"], torch.cat([latents, reference], dim=1))
    ids = call["img_ids"]
    assert ids.shape == (12, 3) and ids[:6, 0].eq(0).all() and ids[6:, 0].eq(1).all()
    assert torch.equal(ids[6:, 1:], ids[:6, 1:]) and torch.equal(ids[:6], flux_image_ids(4, 6))
    assert torch.equal(out, latents + 1.0)  # the velocity of the generated tokens only
    with pytest.raises(ValueError, match="must match the generated ones"):
        velocity(latents, torch.tensor([1.0, 0.5]),
                 dataclasses.replace(cond, reference_latents=torch.randn(2, 4, 16)))
    assert reference_shapes("flux", (6, 16)) == {"reference_latents": (6, 16)}


def test_conditioning_carries_reference_rows_through_select_and_cat():
    cond = Conditioning(encoder_hidden_states=torch.zeros(3, 2, 4), reference_latents=torch.arange(3.0).view(3, 1, 1))
    picked = Conditioning.cat([cond.select([2, 0]), cond.select([1])])
    assert picked.reference_latents.flatten().tolist() == [2.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="reference_latents must have batch 3"):
        Conditioning(encoder_hidden_states=torch.zeros(3, 2, 4), reference_latents=torch.zeros(2, 1, 1))
    with pytest.raises(ValueError, match="None in some items only"):
        Conditioning.cat([cond, Conditioning(encoder_hidden_states=torch.zeros(1, 2, 4))])


class _Images:
    """Conditioning images by prompt id (a gradient whose brightness is the id), recording each load."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def load(self, ids):
        self.calls.append(list(ids))
        ramp = torch.linspace(0, 1, 16).expand(3, 16, 16)
        return torch.stack([(ramp * (i % 5 + 1) / 5) for i in ids])


def test_step_references_encode_each_held_slot_once_and_poison_the_others():
    from leangrpo_mcore.engine.references import StepReferences

    images, decoder = _Images(), build_vae("tiny", "flux", latent_channels=4, spatial_factor=8, seed=5)
    references = StepReferences(images, decoder, "flux", slots=[2, 0, 2])
    cond, sources = references.attach(Conditioning(encoder_hidden_states=torch.zeros(3, 2, 4)), [7, 8, 9])
    assert images.calls == [[7, 9]]  # this rank's slots 0 and 2, one read
    expected = encode_references("flux", decoder, _Images().load([7, 9]))["reference_latents"]
    assert torch.equal(cond.reference_latents[[0, 2]], expected) and torch.isnan(cond.reference_latents[1]).all()
    assert sorted(sources) == [7, 9] and torch.equal(sources[9], _Images().load([9])[0])
    shared = cond.select([0, 0, 2])  # the generations of a group share their slot's encoding
    assert torch.equal(shared.reference_latents[0], shared.reference_latents[1])
