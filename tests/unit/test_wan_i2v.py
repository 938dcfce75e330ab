"""Wan image-to-video against diffusers: the policy equals ``WanTransformer3DModel`` with CLIP image tokens and
channel-concatenated conditioning (Wan2.1-I2V's layout), converts both ways bit-exactly, and its rollouts equal
``WanImageToVideoPipeline``'s (tiny random transformer, VAE and CLIP vision model; same noise, image and text
embeddings; Euler) in all three released layouts: Wan2.1-I2V (mask + image latents + CLIP tokens), Wan2.2-I2V-A14B
(two experts, no CLIP) and Wan2.2-TI2V's first-frame conditioning (``expand_timesteps``)."""

import json

import numpy as np
import pytest

from tests.once import once_per_process
import torch
import transformers
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
from PIL import Image

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.data.vae import LatentDecoder
from leangrpo_mcore.data.wan_image import clip_image_tokens, concat_condition, first_frame_condition, first_frame_mask
from leangrpo_mcore.diffusion.sampler import SDEParams, rollout
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import WanVelocity
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models import load_policy
from leangrpo_mcore.models.wan import PRESETS, WanConfig, WanModel

pytestmark = pytest.mark.slow

HEIGHT, WIDTH, FRAMES, STEPS, SHIFT, CFG = 64, 48, 5, 5, 5.0, 4.0
TEXT = 512  # diffusers' Wan attention takes the tokens before the last 512 as the image tokens


def _expert(preset: str, seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    hyper = {k: v for k, v in PRESETS[preset].items() if k != "boundary_ratio"}
    model = WanTransformer3DModel(**hyper).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _vae() -> AutoencoderKLWan:
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=torch.randn(4, generator=gen).tolist(),
                            latents_std=(torch.rand(4, generator=gen) + 0.5).tolist()).eval()


def _clip():
    torch.manual_seed(5)
    config = transformers.CLIPVisionConfig(hidden_size=20, intermediate_size=37, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return transformers.CLIPVisionModel(config).eval(), processor


@pytest.fixture(scope="module")
@once_per_process
def image():
    gen = np.random.default_rng(0)
    return Image.fromarray(gen.integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8))


def _pixels(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255


def _text():
    gen = torch.Generator().manual_seed(6)
    return torch.randn(2, TEXT, 16, generator=gen), torch.randn(2, TEXT, 16, generator=gen)


def _rollout(policy, latents, conditioning, *, first_frame=False):
    sigmas = get_sigmas("wan", STEPS, shift=SHIFT)
    none = torch.zeros(latents.shape[0], STEPS, dtype=torch.bool)
    velocity = WanVelocity(policy, sigma_kind="wan", cfg_scale=CFG, first_frame=first_frame)
    batch = latents.shape[0]
    return rollout(velocity, latents, sigmas, conditioning, sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas),
                   selected=none, sde_steps=none, noise_seeds=torch.zeros_like(none, dtype=torch.long),
                   prompt_ids=torch.arange(batch), generation_ids=torch.zeros(batch, dtype=torch.long)).final_latents


def _pipeline(root, **parts) -> WanImageToVideoPipeline:
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=_vae(),
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), **parts)
    pipe.save_pretrained(str(root))
    return pipe


def _run_pipeline(pipe, image, noise, text, negative):
    with torch.no_grad():
        return pipe(image=image, prompt_embeds=text, negative_prompt_embeds=negative, latents=noise.clone(),
                    height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=CFG,
                    output_type="latent").frames


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_policy_with_clip_tokens_equals_diffusers_and_round_trips(tmp_path):
    ref = _expert("wan-tiny-i2v", 1)
    ref.save_pretrained(str(tmp_path / "diffusers"))
    assert convert_main(["diffusers-to-mcore", "--model", "wan", "--src", str(tmp_path / "diffusers"),
                         "--dst", str(tmp_path / "ours")]) == 0
    policy = load_policy(tmp_path / "ours", backend="local")
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 12, 2, 8, 6, generator=gen)
    text, clip = torch.randn(2, TEXT, 16, generator=gen), torch.randn(2, 17, 20, generator=gen)
    for timestep in (torch.tensor([937.0, 12.5]), torch.rand(2, 2 * 4 * 3, generator=gen) * 1000):
        with torch.no_grad():
            expected = ref(hidden, timestep, text, encoder_hidden_states_image=clip, return_dict=False)[0]
            assert _rel(policy(hidden, timestep, text, clip), expected) <= 1e-5
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "back")]) == 0
    back = WanTransformer3DModel.from_pretrained(str(tmp_path / "back")).state_dict()
    assert sorted(back) == sorted(ref.state_dict())
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    with pytest.raises(ValueError, match="encoder_hidden_states_image"):
        policy(hidden, timestep, text)


def test_wan21_i2v_rollout_equals_the_pipeline(tmp_path, image):
    encoder, processor = _clip()
    pipe = _pipeline(tmp_path / "pipe", image_encoder=encoder, image_processor=processor,
                     transformer=_expert("wan-tiny-i2v", 1))
    text, negative = _text()
    noise = torch.randn(2, 4, 2, 8, 6, generator=torch.Generator().manual_seed(8))
    expected = _run_pipeline(pipe, image, noise, text, negative)
    policy = load_policy(tmp_path / "pipe" / "transformer", backend="local")
    pixels = _pixels(image)
    decoder = LatentDecoder(pipe.vae, "wan")
    condition = concat_condition(decoder, pixels, FRAMES, temporal=4).expand(2, -1, -1, -1, -1)
    clip = clip_image_tokens(encoder, processor, pixels).expand(2, -1, -1)
    cond = Conditioning(encoder_hidden_states=text, negative_encoder_hidden_states=negative, reference_latents=condition,
                        image_embeds=clip)
    assert _rel(_rollout(policy, noise, cond), expected) <= 1e-5
    # the mask: one channel per frame of the first temporal group, 1 on the image frame only
    assert first_frame_mask(FRAMES, 8, 6, 4)[:, 0].eq(1).all() and first_frame_mask(FRAMES, 8, 6, 4)[:, 1].eq(0).all()
    with pytest.raises(ValueError, match="conditioning channels"):
        _rollout(policy, noise, Conditioning(encoder_hidden_states=text, negative_encoder_hidden_states=negative,
                                             image_embeds=clip))


def test_wan22_i2v_a14b_rollout_equals_the_pipeline(tmp_path, image):
    pipe = _pipeline(tmp_path / "pipe", transformer=_expert("wan-tiny-i2v-a14b", 1),
                     transformer_2=_expert("wan-tiny-i2v-a14b", 2), boundary_ratio=0.9)
    text, negative = _text()
    noise = torch.randn(2, 4, 2, 8, 6, generator=torch.Generator().manual_seed(9))
    expected = _run_pipeline(pipe, image, noise, text, negative)
    policy = load_policy(tmp_path / "pipe", backend="local")
    assert policy.config.boundary_ratio == 0.9 and policy.config.diffusers_pipeline == "WanImageToVideoPipeline"
    condition = concat_condition(LatentDecoder(pipe.vae, "wan"), _pixels(image), FRAMES, temporal=4)
    cond = Conditioning(encoder_hidden_states=text, negative_encoder_hidden_states=negative,
                        reference_latents=condition.expand(2, -1, -1, -1, -1))
    assert _rel(_rollout(policy, noise, cond), expected) <= 1e-5
    assert convert_main(["diffusers-to-mcore", "--model", "wan", "--src", str(tmp_path / "pipe"), "--dst",
                         str(tmp_path / "ours")]) == 0
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "model_index.json").read_text())["_class_name"] == "WanImageToVideoPipeline"
    for component, original in (("transformer", pipe.transformer), ("transformer_2", pipe.transformer_2)):
        back = WanTransformer3DModel.from_pretrained(str(tmp_path / "back" / component)).state_dict()
        assert all(torch.equal(back[k], v) for k, v in original.state_dict().items())


def test_ti2v_first_frame_rollout_equals_the_pipeline(tmp_path, image):
    pipe = _pipeline(tmp_path / "pipe", transformer=_expert("tiny", 1), expand_timesteps=True)
    text, negative = _text()
    noise = torch.randn(2, 4, 2, 8, 6, generator=torch.Generator().manual_seed(10))
    expected = _run_pipeline(pipe, image, noise, text, negative)
    policy = load_policy(tmp_path / "pipe" / "transformer", backend="local")
    first = first_frame_condition(LatentDecoder(pipe.vae, "wan"), _pixels(image)).expand(2, -1, -1, -1, -1)
    cond = Conditioning(encoder_hidden_states=text, negative_encoder_hidden_states=negative, reference_latents=first)
    # the sampler's latents are the frames to generate; the image is the first latent frame of the result
    generated = _rollout(policy, noise[:, :, 1:], cond, first_frame=True)
    assert _rel(first, expected[:, :, :1]) <= 1e-6  # (z - mean) / std here, (z - mean) * (1 / std) there
    assert _rel(torch.cat([first, generated], dim=2), expected) <= 1e-5


def test_image_conditioning_configs():
    assert WanConfig.from_diffusers_config(PRESETS["wan2.1-i2v-14b"]).condition_channels == 20
    with torch.device("meta"):
        i2v = WanModel(WanConfig.from_diffusers_config(PRESETS["wan2.1-i2v-14b"]), backend="local")
        reference = WanTransformer3DModel(**PRESETS["wan2.1-i2v-14b"])
    # Wan2.1-I2V-14B: the T2V model, a wider patch embedding, the CLIP embedder and 40 x the image keys/values
    assert i2v.num_parameters() == sum(p.numel() for p in reference.parameters()) == 16_394_878_784
    with pytest.raises(UserError, match="FLF2V"):
        WanConfig.from_diffusers_config({**PRESETS["wan2.1-i2v-14b"], "pos_embed_seq_len": 514})
    with pytest.raises(UserError, match="both image_dim and added_kv_proj_dim"):
        WanConfig.from_diffusers_config({**PRESETS["tiny"], "image_dim": 20})


def test_a_run_of_an_image_to_video_checkpoint_is_one_error_line(tmp_path, capsys):
    from leangrpo_mcore.cli.train import main as train_main

    argv = ["--config", "yaml_configs/tiny/wan.yaml", "model.preset=wan-tiny-i2v", f"train.output_dir={tmp_path}",
            "parallel.dp_shard=1", "parallel.dp_replicate=1", "parallel.reshard_after_forward=true"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err and "image-to-video" in errors[0], err


def test_a_run_reads_clip_tokens_as_the_pipeline_encodes_them(tmp_path, image):
    """``model.image_encoder_path`` (a pipeline directory): the run's reference encoder gives the CLIP tokens of
    WanImageToVideoPipeline.encode_image on the same image, beside the concatenated latents, in the shapes the
    simulator allocates; a missing, wrong or unneeded encoder is one line."""
    from leangrpo_mcore.data.reference import ReferenceRun, encode_references, reference_shapes

    encoder, processor = _clip()
    pipe = _pipeline(tmp_path / "pipe", image_encoder=encoder, image_processor=processor,
                     transformer=_expert("wan-tiny-i2v", 1))
    hyper = WanConfig.from_diffusers_config(PRESETS["wan-tiny-i2v"]).to_diffusers_config()
    run = ReferenceRun(hyper=hyper, frames=FRAMES, image_encoder_path=str(tmp_path / "pipe"))
    pixels = _pixels(image)
    fields = encode_references("wan", LatentDecoder(pipe.vae, "wan"), pixels, run)
    with torch.no_grad():
        expected = pipe.encode_image(image, torch.device("cpu"))
    assert torch.equal(fields["image_embeds"], expected.float())
    assert fields["image_embeds"].shape == (1, 17, 20)  # (32 / 8)^2 patches and the class token, width image_dim
    shapes = reference_shapes("wan", (4, 2, 8, 6), run)
    assert shapes == {"reference_latents": (8, 2, 8, 6), "image_embeds": (17, 20)}
    assert reference_shapes("wan", (4, 2, 8, 6), ReferenceRun(hyper=hyper, frames=FRAMES, reads_weights=False)
                            )["image_embeds"] == (257, 20)  # the simulator without the encoder: ViT-H/14's tokens
    with pytest.raises(UserError, match="set model.image_encoder_path"):
        encode_references("wan", LatentDecoder(pipe.vae, "wan"), pixels, ReferenceRun(hyper=hyper, frames=FRAMES))
    with pytest.raises(UserError, match="no CLIP image encoder there"):
        encode_references("wan", LatentDecoder(pipe.vae, "wan"), pixels,
                          ReferenceRun(hyper=hyper, frames=FRAMES, image_encoder_path=str(tmp_path)))
    plain = WanConfig.from_diffusers_config(PRESETS["wan-tiny-i2v-a14b"]).to_diffusers_config()
    with pytest.raises(UserError, match="reads no CLIP image tokens"):
        reference_shapes("wan", (4, 2, 8, 6), ReferenceRun(hyper=plain, frames=FRAMES,
                                                           image_encoder_path=str(tmp_path / "pipe")))


def test_an_image_encoder_no_run_reads_is_refused(tmp_path):
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine import build

    for config in ("yaml_configs/tiny/flux.yaml", "yaml_configs/tiny/wan.yaml"):
        cfg = load_config(config, [f"model.image_encoder_path={tmp_path}"])
        with pytest.raises(UserError, match="model.image_encoder_path is read only by"):
            build.build_data_parts(cfg, *build.policy_hyper(cfg), torch.device("cpu"))
