"""Qwen-Image against diffusers' QwenImagePipeline on a tiny random stack built here (a byte-level Qwen2 tokenizer
from a small vocab, a tiny Qwen2_5_VLForConditionalGeneration, a tiny QwenImageTransformer2DModel, a tiny
AutoencoderKLQwenImage and the released scheduler config): the text conditioning equals ``encode_prompt`` (template,
dropped system turn, padding mask, truncation, the negative prompt), the precomputed cache reproduces it, the ODE
rollout with and without true CFG equals the pipeline's from the same noise, and the decoded images equal its
output (the VAE's latent mean and std)."""

from types import SimpleNamespace

import pytest
import torch

from leangrpo_mcore.data.conditioning import TextDims, build_text_encoder
from leangrpo_mcore.data.diffusers_text import pipeline_text_dims
from leangrpo_mcore.data.embedding_cache import write_embedding_cache
from leangrpo_mcore.data.vae import build_vae, latent_shape
from leangrpo_mcore.diffusion.sde import ode_step
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import QwenImageVelocity, build_velocity_fn
from leangrpo_mcore.models import load_policy
from tests.unit.test_qwen_image_model import make_diffusers_qwen
from tests.unit.test_sigmas import QWEN_IMAGE_SCHEDULER
from tests.once import once_per_process

TEXT_WIDTH, MAX_LENGTH = 24, 160  # the byte-level template keeps ~120 states of a short prompt
PROMPTS = ["a red cat", "a dog on the sea at night, painted in oil with a red sky and a tall white lighthouse",
           "a red cat"]
NEGATIVE = " "
HEIGHT, WIDTH, STEPS = 48, 32, 4  # a 6 x 4 latent grid, 3 x 2 = 6 packed tokens


def _tokenizer():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "a"), ("e", "d"), ("Ġ", "c"), ("a", "t"), ("Ġ", "t"), ("h", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


@pytest.fixture(scope="module")
@once_per_process
def stack(tmp_path_factory):
    """The tiny stack saved in a diffusers pipeline layout, and QwenImagePipeline over the same components."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen_image")
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 1]},
                         bos_token_id=end, eos_token_id=end, pad_token_id=end),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_WIDTH,
                           fullatt_block_indexes=[0]))).eval()
    transformer = make_diffusers_qwen(root / "transformer", seed=1)
    vae = build_vae("tiny", "qwen_image", latent_channels=16, seed=2).vae
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER)
    tokenizer.save_pretrained(str(root / "tokenizer"))
    text_encoder.save_pretrained(str(root / "text_encoder"))
    vae.save_pretrained(str(root / "vae"))
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return SimpleNamespace(root=root, pipe=pipe)


def _encoder(stack, negative=NEGATIVE):
    config = SimpleNamespace(text_encoder="diffusers", text_encoder_path=str(stack.root))
    dims = pipeline_text_dims(stack.root, "qwen_image", max_length=MAX_LENGTH)
    return build_text_encoder(config, "qwen_image", dims, negative_prompt=negative)


def _same_rows(ours_tokens, ours_mask, theirs_tokens, theirs_mask):
    """The real tokens agree; ours keeps no more padding than theirs."""
    mask = torch.ones(theirs_tokens.shape[:2], dtype=torch.bool) if theirs_mask is None else theirs_mask.bool()
    assert ours_tokens.shape == theirs_tokens.shape
    assert torch.equal(mask, torch.ones_like(mask) if ours_mask is None else ours_mask)
    assert torch.allclose(ours_tokens[mask], theirs_tokens[mask], rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(ours_tokens[~mask]) == 0


def test_text_conditioning_equals_encode_prompt(stack):
    assert pipeline_text_dims(stack.root, "qwen_image", max_length=MAX_LENGTH) == TextDims(TEXT_WIDTH, None,
                                                                                           MAX_LENGTH)
    encoder = _encoder(stack)
    cond = encoder(PROMPTS)
    with torch.no_grad():
        embeds, mask = stack.pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LENGTH)
        negative, negative_mask = stack.pipe.encode_prompt([NEGATIVE] * 3, device="cpu",
                                                           max_sequence_length=MAX_LENGTH)
    # The long prompt is cut at MAX_LENGTH states, so both sides keep MAX_LENGTH; the short ones are padded.
    assert embeds.shape == (3, MAX_LENGTH, TEXT_WIDTH) and mask is not None and not mask[0].all()
    _same_rows(cond.encoder_hidden_states, cond.encoder_attention_mask, embeds, mask)
    # The negative prompt's few states, padded to the prompts' length for the batched guidance.
    length = negative.shape[1]
    assert negative_mask is None and length < MAX_LENGTH
    assert torch.allclose(cond.negative_encoder_hidden_states[:, :length], negative, rtol=1e-5, atol=1e-6)
    assert cond.negative_encoder_attention_mask.sum(dim=1).tolist() == [length] * 3
    # Prompts of one length: no padding, no mask, as encode_prompt drops an all-ones mask.
    alone = _encoder(stack, negative=None)([PROMPTS[0]] * 2)
    with torch.no_grad():
        embeds, mask = stack.pipe.encode_prompt([PROMPTS[0]] * 2, device="cpu", max_sequence_length=MAX_LENGTH)
    assert mask is None and alone.encoder_attention_mask is None and alone.negative_encoder_hidden_states is None
    _same_rows(alone.encoder_hidden_states, None, embeds, None)


def test_precomputed_cache_reproduces_the_qwen_image_conditioning(stack, tmp_path):
    diffusers = _encoder(stack)
    write_embedding_cache(diffusers, PROMPTS + [NEGATIVE], tmp_path / "cache")
    cached = build_text_encoder(SimpleNamespace(text_encoder="precomputed", text_encoder_path=str(tmp_path / "cache")),
                                "qwen_image", diffusers.dims, negative_prompt=NEGATIVE)
    expected, got = diffusers(PROMPTS), cached(PROMPTS)
    for field in ("encoder_hidden_states", "negative_encoder_hidden_states"):
        # The cache embedded the prompts in another batch: equal up to the encoder's batched GEMM rounding.
        assert torch.allclose(getattr(got, field), getattr(expected, field), rtol=1e-5, atol=1e-6), field
    for field in ("encoder_attention_mask", "negative_encoder_attention_mask"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field


def _ours(stack, noise, prompts, cfg_scale):
    policy = load_policy(stack.root / "transformer", backend="local")
    cond = _encoder(stack, negative=NEGATIVE if cfg_scale > 1 else None)(prompts)
    velocity = build_velocity_fn("qwen_image", policy, sigma_kind="qwen_image", latent_height=HEIGHT // 8,
                                 latent_width=WIDTH // 8, cfg_scale=cfg_scale)
    sigmas = get_sigmas("qwen_image", STEPS, image_seq_len=noise.shape[1])
    x = noise
    with torch.no_grad():
        for t in range(STEPS):
            x = ode_step(velocity(x, sigmas[t].expand(x.shape[0]), cond), x, sigmas[t], sigmas[t + 1])
    return x


@pytest.mark.slow
@pytest.mark.parametrize("cfg_scale", [4.0, 1.0])
def test_ode_rollout_and_decoding_equal_the_pipeline(stack, cfg_scale):
    assert latent_shape("qwen_image", HEIGHT, WIDTH, channels=16) == (6, 64)
    prompts = PROMPTS[:2]
    noise = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    call = dict(prompt=prompts, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, latents=noise,
                max_sequence_length=MAX_LENGTH, true_cfg_scale=cfg_scale,
                negative_prompt=NEGATIVE if cfg_scale > 1 else None)
    with torch.no_grad():
        expected = stack.pipe(**call, output_type="latent").images
        images = stack.pipe(**call, output_type="pt").images
    ours = _ours(stack, noise, prompts, cfg_scale)
    assert ours.shape == expected.shape == (2, 6, 64)
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5
    decoder = build_vae("diffusers", "qwen_image", stack.root, latent_channels=16)
    decoded = decoder.decode(ours, height=HEIGHT, width=WIDTH).images
    assert decoded.shape == images.shape == (2, 3, HEIGHT, WIDTH)
    assert (decoded - images).abs().max().item() < 1e-4


def test_true_cfg_is_the_norm_rescaled_combination_of_unpadded_branches(stack):
    policy = load_policy(stack.root / "transformer", backend="local")
    gen = torch.Generator().manual_seed(4)
    tokens, negative = torch.randn(2, 5, TEXT_WIDTH, generator=gen), torch.randn(2, 5, TEXT_WIDTH, generator=gen)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    negative_mask = torch.tensor([[True] * 2 + [False] * 3] * 2)
    cond = Conditioning(tokens, negative_encoder_hidden_states=negative, encoder_attention_mask=mask,
                        negative_encoder_attention_mask=negative_mask)
    latents, sigma = torch.randn(2, 6, 64, generator=gen), torch.tensor([0.9, 0.35])
    velocity = build_velocity_fn("qwen_image", policy, sigma_kind="qwen_image", latent_height=6, latent_width=4,
                                 cfg_scale=4.0)
    assert isinstance(velocity, QwenImageVelocity)
    with torch.no_grad():
        guided = velocity(latents, sigma, cond)
        rows = []
        for i in range(2):  # each branch of each sample alone, its padding cut off (the pipeline's way)
            branch = [policy(latents[i:i + 1], t[i:i + 1, :int(m[i].sum())], None, sigma[i:i + 1], (1, 3, 2))
                      for t, m in ((tokens, mask), (negative, negative_mask))]
            cond_v, uncond_v = (v.double() for v in branch)
            combined = uncond_v + 4.0 * (cond_v - uncond_v)
            rows.append(combined * cond_v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    expected = torch.cat(rows)
    # Norm-relative: the scale 4 amplifies the two branches' fp32 rounding in single elements.
    assert ((guided.double() - expected).norm() / expected.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        velocity(latents, sigma, Conditioning(tokens, encoder_attention_mask=mask))


def test_qwen_image_vae_normalisation():
    decoder = build_vae("tiny", "qwen_image", latent_channels=16, seed=0)
    config = decoder.vae.config
    mean = torch.tensor(config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, 16, 1, 1, 1)
    assert config.latents_std[0] == 2.8184 and decoder.spatial_factor == 8  # the release's statistics
    z = torch.randn(1, 16, 4, 2, generator=torch.Generator().manual_seed(1))
    packed = z.reshape(1, 16, 2, 2, 1, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 2, 64)  # the pipeline's packing
    with torch.no_grad():
        expected = (decoder.vae.decode(z.unsqueeze(2) * std + mean).sample[:, :, 0] / 2 + 0.5).clamp(0, 1)
        images = decoder.decode(packed, height=32, width=16).images
        latents = decoder.encode(images)
        mode = decoder.vae.encode(images.unsqueeze(2) * 2 - 1).latent_dist.mode()
    assert images.shape == (1, 3, 32, 16) and torch.allclose(images, expected, atol=1e-6)
    normalised = ((mode - mean) / std)[:, :, 0]
    assert torch.allclose(latents, normalised.reshape(1, 16, 2, 2, 1, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 2, 64),
                          atol=1e-5)


def test_prompts_are_trimmed_to_the_longest_and_the_negative_to_the_same_length():
    dims = TextDims(8, None, 16)
    encoder = build_text_encoder(SimpleNamespace(text_encoder="hashed"), "qwen_image", dims, negative_prompt="")
    cond = encoder(["a cat", "a red cat on a mat", "a cat"])
    # 3 and 7 tokens with the end token; the empty negative prompt has 1
    assert cond.encoder_hidden_states.shape == cond.negative_encoder_hidden_states.shape == (3, 7, 8)
    assert cond.encoder_attention_mask.sum(dim=1).tolist() == [3, 7, 3]
    assert cond.negative_encoder_attention_mask.sum(dim=1).tolist() == [1, 1, 1]
    assert torch.count_nonzero(cond.encoder_hidden_states[~cond.encoder_attention_mask]) == 0
    full = encoder.embed(["a red cat on a mat"])
    assert torch.equal(cond.encoder_hidden_states[1], full.tokens[0, :7])
    # one length, no padding: no mask; evaluation's negative (a longer one) pads the prompts instead
    alone = build_text_encoder(SimpleNamespace(text_encoder="hashed"), "qwen_image", dims)(["a cat", "a dog"])
    assert alone.encoder_attention_mask is None and alone.encoder_hidden_states.shape[1] == 3
    guided = encoder.add_negative(alone, "ugly blurry low quality art")
    assert guided.encoder_hidden_states.shape == guided.negative_encoder_hidden_states.shape == (2, 6, 8)
    assert guided.encoder_attention_mask.sum(dim=1).tolist() == [3, 3]
    assert guided.negative_encoder_attention_mask is None  # the negative fills the length
