"""SD3 conditioning: the diffusers text encoders against StableDiffusion3Pipeline.encode_prompt on tiny random
CLIP-L / CLIP-G / T5, the precomputed-embedding cache, classifier-free guidance of an SD3 policy, and the SD3 VAE's
scaling and shift factors."""

from types import SimpleNamespace

import pytest

from tests.once import once_per_process
import torch

from leangrpo_mcore.data.conditioning import TextDims, build_text_encoder
from leangrpo_mcore.data.diffusers_text import pipeline_text_dims
from leangrpo_mcore.data.embedding_cache import write_embedding_cache
from leangrpo_mcore.data.vae import build_vae, latent_shape
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import SD3Velocity, build_velocity_fn
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.vae_factors import SD3_SCALING_FACTOR, SD3_SHIFT_FACTOR

WORDS = ["a", "red", "cat", "dog", "on", "the", "sea", "blue", "photo", "of", "ugly", ","]
T5_LENGTH = 9
PROMPTS = ["a red cat on the sea", "a blue dog", "a red cat on the sea"]


def _tokenizer(path, max_length):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
@once_per_process
def sd3_pipeline_dir(tmp_path_factory):
    """A diffusers-layout SD3 text stack: CLIP-L (width 12, projection 8), CLIP-G (width 16, projection 10), T5
    (d_model 40 > 12 + 16, so the CLIP states are zero-padded)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("sd3")
    vocab = len(WORDS) + 3
    for name, width, projection in (("text_encoder", 12, 8), ("text_encoder_2", 16, 10)):
        CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=projection, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        )).save_pretrained(str(root / name))
    T5EncoderModel(T5Config(vocab_size=vocab, d_model=40, d_kv=8, d_ff=24, num_layers=1, num_heads=2)
                   ).save_pretrained(str(root / "text_encoder_3"))
    for name, length in (("tokenizer", 77), ("tokenizer_2", 77), ("tokenizer_3", 512)):
        _tokenizer(root / name, length)
    return root


def _diffusers_pipeline(root):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    parts = {name: CLIPTextModelWithProjection.from_pretrained(str(root / name)).eval()
             for name in ("text_encoder", "text_encoder_2")}
    parts["text_encoder_3"] = T5EncoderModel.from_pretrained(str(root / "text_encoder_3")).eval()
    parts.update({name: AutoTokenizer.from_pretrained(str(root / name))
                  for name in ("tokenizer", "tokenizer_2", "tokenizer_3")})
    return StableDiffusion3Pipeline(transformer=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(), **parts)


def test_diffusers_sd3_encoders_match_the_pipelines_encode_prompt(sd3_pipeline_dir):
    dims = pipeline_text_dims(sd3_pipeline_dir, "sd3", max_length=77 + T5_LENGTH)
    assert dims == TextDims(40, 18, 77 + T5_LENGTH)
    config = SimpleNamespace(text_encoder="diffusers", text_encoder_path=str(sd3_pipeline_dir))
    cond = build_text_encoder(config, "sd3", dims, negative_prompt="ugly")(PROMPTS)
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = _diffusers_pipeline(sd3_pipeline_dir).encode_prompt(
            PROMPTS, None, None, device="cpu", do_classifier_free_guidance=True, negative_prompt="ugly",
            max_sequence_length=T5_LENGTH)
    assert cond.encoder_hidden_states.shape == embeds.shape == (3, 77 + T5_LENGTH, 40)
    assert cond.pooled_projections.shape == pooled.shape == (3, 18)
    assert torch.allclose(cond.encoder_hidden_states, embeds, rtol=1e-5, atol=1e-6)
    assert torch.allclose(cond.pooled_projections, pooled, rtol=1e-5, atol=1e-6)
    assert torch.allclose(cond.negative_encoder_hidden_states, negative, rtol=1e-5, atol=1e-6)
    assert torch.allclose(cond.negative_pooled_projections, negative_pooled, rtol=1e-5, atol=1e-6)
    # The CLIP states (28 channels) are zero-padded to T5's 40; T5's states follow CLIP's 77 tokens.
    assert torch.count_nonzero(cond.encoder_hidden_states[:, :77, 28:]) == 0
    assert torch.count_nonzero(cond.encoder_hidden_states[:, 77:, 28:]) > 0


def test_precomputed_cache_reproduces_the_sd3_conditioning(sd3_pipeline_dir, tmp_path):
    dims = TextDims(40, 18, 77 + T5_LENGTH)
    diffusers = build_text_encoder(SimpleNamespace(text_encoder="diffusers", text_encoder_path=str(sd3_pipeline_dir)),
                                   "sd3", dims, negative_prompt="")
    write_embedding_cache(diffusers, PROMPTS + [""], tmp_path / "cache")
    cached = build_text_encoder(SimpleNamespace(text_encoder="precomputed", text_encoder_path=str(tmp_path / "cache")),
                                "sd3", dims, negative_prompt="")
    expected, got = diffusers(PROMPTS), cached(PROMPTS)
    for field in ("encoder_hidden_states", "pooled_projections", "negative_encoder_hidden_states",
                  "negative_pooled_projections"):
        # The cache embedded the prompts in another batch: equal up to the encoders' batched GEMM rounding.
        assert torch.allclose(getattr(got, field), getattr(expected, field), rtol=1e-5, atol=1e-6), field
    with pytest.raises(Exception, match="family"):
        build_text_encoder(SimpleNamespace(text_encoder="precomputed", text_encoder_path=str(tmp_path / "cache")),
                           "flux", dims)


def test_cfg_of_an_sd3_policy_is_the_two_branch_combination():
    policy = build_policy("sd3-tiny", seed=1)
    gen = torch.Generator().manual_seed(0)
    cond = Conditioning(encoder_hidden_states=torch.randn(2, 5, 24, generator=gen),
                        pooled_projections=torch.randn(2, 20, generator=gen),
                        negative_encoder_hidden_states=torch.randn(2, 5, 24, generator=gen),
                        negative_pooled_projections=torch.randn(2, 20, generator=gen))
    latents, sigma = torch.randn(2, 16, 8, 8, generator=gen), torch.tensor([0.9, 0.4])
    velocity = build_velocity_fn("sd3", policy, sigma_kind="sd3", cfg_scale=4.5)
    assert isinstance(velocity, SD3Velocity)
    with torch.no_grad():
        guided = velocity(latents, sigma, cond)
        # The pipeline passes the scheduler's timestep sigma * 1000 to the transformer unchanged.
        cond_v = policy(latents, cond.encoder_hidden_states, cond.pooled_projections, sigma * 1000)
        uncond_v = policy(latents, cond.negative_encoder_hidden_states, cond.negative_pooled_projections, sigma * 1000)
        plain = build_velocity_fn("sd3", policy, sigma_kind="sd3")(latents, sigma, cond)
    assert torch.allclose(guided, uncond_v + 4.5 * (cond_v - uncond_v), rtol=1e-5, atol=1e-5)
    assert torch.allclose(plain, cond_v, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="negative_pooled_projections"):
        velocity(latents, sigma, Conditioning(cond.encoder_hidden_states, cond.pooled_projections,
                                              cond.negative_encoder_hidden_states))


def test_sd3_vae_scaling_and_shift():
    assert latent_shape("sd3", 64, 32, channels=16) == (16, 8, 4)
    decoder = build_vae("tiny", "sd3", latent_channels=16, seed=0)
    assert (decoder.vae.config.scaling_factor, decoder.vae.config.shift_factor) == (1.5305, 0.0609)
    z = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = (decoder.vae.decode(z / SD3_SCALING_FACTOR + SD3_SHIFT_FACTOR).sample / 2 + 0.5).clamp(0, 1)
        images = decoder.decode(z).images
        latents = decoder.encode(images)
        mode = decoder.vae.encode(images * 2 - 1).latent_dist.mode()
    assert images.shape == (1, 3, 32, 32) and torch.allclose(images, expected, atol=1e-6)
    assert torch.allclose(latents, (mode - SD3_SHIFT_FACTOR) * SD3_SCALING_FACTOR, atol=1e-6)
