import pytest
import torch

from leangrpo_mcore.data.vae import build_vae, latent_shape, pack_latents, to_unit_range, unpack_latents
from leangrpo_mcore.errors import UserError


def _params_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_pack_unpack_match_diffusers_flux_pipeline_exactly():
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    gen = torch.Generator().manual_seed(0)
    for batch, channels, height, width in [(2, 4, 64, 48), (1, 16, 32, 96)]:
        latents = torch.randn(batch, channels, height // 8, width // 8, generator=gen)
        packed = pack_latents(latents)
        assert packed.shape == (batch, *latent_shape("flux", height, width, 1, channels))
        reference = FluxPipeline._pack_latents(latents, batch, channels, height // 8, width // 8)
        assert torch.equal(packed, reference)
        unpacked = unpack_latents(packed, height, width)
        assert torch.equal(unpacked, FluxPipeline._unpack_latents(packed, height, width, 8))
        assert torch.equal(unpacked, latents)
    with pytest.raises(ValueError, match="do not match a 64x64 image"):
        unpack_latents(packed, 64, 64)


def test_latent_shapes_and_their_errors():
    assert latent_shape("flux", 512, 512, 1, 16) == (1024, 64)
    assert latent_shape("wan", 480, 832, 81, 16) == (16, 21, 60, 104)
    assert latent_shape("wan", 512, 512, 1, 16) == (16, 1, 64, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        latent_shape("flux", 520, 512)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        latent_shape("wan", 512, 512, 8)
    with pytest.raises(ValueError, match="frames must be 1"):
        latent_shape("flux", 512, 512, 5)
    with pytest.raises(ValueError, match="unknown model family"):
        latent_shape("sdxl", 512, 512)


def test_tiny_flux_vae_is_seeded_and_round_trips_shapes():
    state = torch.get_rng_state()
    vae = build_vae("tiny", "flux", seed=3, latent_channels=4)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    assert _params_equal(vae.vae, build_vae("tiny", "flux", seed=3, latent_channels=4).vae)
    assert not _params_equal(vae.vae, build_vae("tiny", "flux", seed=4, latent_channels=4).vae)
    images = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    latents = vae.encode(images)
    assert latents.shape == (2, *latent_shape("flux", 64, 48, 1, 4)) and latents.dtype == torch.float32
    decoded = vae.decode(latents, height=64, width=48)
    assert decoded.video is None
    assert decoded.images.shape == (2, 3, 64, 48) and decoded.images.dtype == torch.float32
    assert 0.0 <= decoded.images.min() and decoded.images.max() <= 1.0 and decoded.images.std() > 0.01
    # Independent reference: diffusers' own decode of the FLUX-normalised, unpacked latents.
    config = vae.vae.config
    assert (config.scaling_factor, config.shift_factor) == (0.3611, 0.1159)
    with torch.no_grad():
        raw = vae.vae.decode(unpack_latents(latents, 64, 48) / 0.3611 + 0.1159).sample
    assert torch.allclose(decoded.images, (raw / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="height and width"):
        vae.decode(latents)


def test_diffusers_wan_vae_normalisation_and_video(tmp_path):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    mean, std = [0.5, -0.25, 1.0, 0.0], [2.0, 0.5, 1.5, 1.0]
    reference = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=mean, latents_std=std,
    ).eval()
    reference.save_pretrained(str(tmp_path / "pipe" / "vae"))
    vae = build_vae("diffusers", "wan", tmp_path / "pipe", latent_channels=4, batch_size=1)
    latents = torch.randn(2, *latent_shape("wan", 32, 48, 5, 4), generator=torch.Generator().manual_seed(2))
    decoded = vae.decode(latents)
    assert decoded.video.shape == (2, 3, 5, 32, 48) and decoded.images.shape == (2, 3, 32, 48)
    assert torch.equal(decoded.images, decoded.video[:, :, 0])
    view = (1, 4, 1, 1, 1)
    with torch.no_grad():
        raw = reference.decode(latents / (1.0 / torch.tensor(std).view(view)) + torch.tensor(mean).view(view)).sample
    assert torch.allclose(decoded.video, to_unit_range(raw), rtol=0, atol=1e-5)
    encoded = vae.encode(decoded.images)
    assert encoded.shape == (2, 4, 1, 4, 6)


def test_tiny_wan_and_loader_errors(tmp_path):
    wan = build_vae("tiny", "wan", latent_channels=4)
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(0))
    decoded = wan.decode(wan.encode(video))
    assert decoded.video.shape == (1, 3, 5, 32, 32) and 0 <= decoded.video.min() and decoded.video.max() <= 1
    build_vae("tiny", "flux", latent_channels=4).vae.save_pretrained(str(tmp_path / "flux_vae"))
    loaded = build_vae("diffusers", "flux", tmp_path / "flux_vae", latent_channels=4)
    assert _params_equal(loaded.vae, build_vae("tiny", "flux", latent_channels=4).vae)
    with pytest.raises(UserError, match="is a AutoencoderKL, a wan policy needs AutoencoderKLWan"):
        build_vae("diffusers", "wan", tmp_path / "flux_vae")
    with pytest.raises(UserError, match="no diffusers VAE at"):
        build_vae("diffusers", "flux", tmp_path / "missing")
    with pytest.raises(UserError, match="VAE has 4 latent channels, the policy samples 16"):
        build_vae("diffusers", "flux", tmp_path / "flux_vae", latent_channels=16)
    with pytest.raises(UserError, match="needs model.vae_path"):
        build_vae("diffusers", "flux")
    with pytest.raises(ValueError, match="valid: tiny, diffusers"):
        build_vae("random", "flux", latent_channels=4)
    with pytest.raises(ValueError, match="expects 4-channel latents"):
        wan.decode(torch.zeros(1, 8, 1, 4, 4))


def test_wan22_latent_shape_uses_its_16x_vae():
    assert latent_shape("wan", 704, 1280, 49, 48) == (48, 13, 44, 80)
    assert latent_shape("wan", 704, 1280, 49, 16) == (16, 13, 88, 160)  # Wan2.1's VAE: 8x
    assert latent_shape("wan", 704, 1280, 49, 48, spatial_factor=8) == (48, 13, 88, 160)
    with pytest.raises(UserError, match="multiples of 32 .* got 720x1280"):
        latent_shape("wan", 720, 1280, 49, 48)
    assert latent_shape("wan", 720, 1280, 49, 16) == (16, 13, 90, 160)


def test_wan22_vaes_decode_a_16x_grid_to_the_requested_size(tmp_path):
    from diffusers import AutoencoderKLWan

    tiny = build_vae("tiny", "wan", latent_channels=48)
    assert tiny.spatial_factor == 16 and build_vae("tiny", "wan", latent_channels=16).spatial_factor == 8
    latents = torch.randn(1, *latent_shape("wan", 64, 96, 5, 48), generator=torch.Generator().manual_seed(0))
    assert latents.shape == (1, 48, 2, 4, 6)
    decoded = tiny.decode(latents)
    assert decoded.video.shape == (1, 3, 5, 64, 96) and decoded.images.shape == (1, 3, 64, 96)
    assert tiny.encode(decoded.video).shape == latents.shape
    # A diffusers VAE reports its factor from its architecture: 2x2 pixel patch + three down-samplings.
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1, is_residual=True, patch_size=2,
                     in_channels=12, out_channels=12, latents_mean=[0.0] * 48,
                     latents_std=[1.0] * 48).save_pretrained(str(tmp_path / "wan22_vae"))
    loaded = build_vae("diffusers", "wan", tmp_path / "wan22_vae", latent_channels=48, spatial_factor=16)
    assert loaded.spatial_factor == 16 and loaded.decode(latents).video.shape == (1, 3, 5, 64, 96)
    AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1, latents_mean=[0.0] * 48,
                     latents_std=[1.0] * 48).save_pretrained(str(tmp_path / "wan21_layout"))
    with pytest.raises(UserError, match="VAE compresses 8x spatially, the policy expects 16x"):
        build_vae("diffusers", "wan", tmp_path / "wan21_layout", latent_channels=48, spatial_factor=16)
    with pytest.raises(ValueError, match="compresses 8 or 16x, not 4x"):
        build_vae("tiny", "wan", latent_channels=48, spatial_factor=4)


def test_flux_decoder_unpacks_with_its_own_factor():
    vae = build_vae("tiny", "flux", latent_channels=4)
    assert vae.spatial_factor == 8
    latents = torch.randn(1, *latent_shape("flux", 32, 64, 1, 4), generator=torch.Generator().manual_seed(0))
    assert vae.decode(latents, height=32, width=64).images.shape == (1, 3, 32, 64)
