"""Rewards that see the conditioning image: ``reference_images`` reaches the rewards that declare it (alone, in
``weighted``, for videos frame by frame), ``clip_consistency`` against transformers' own processor and model,
``first_frame_consistency`` against the PSNR formula in float64, and the build-time refusal without images."""

import numpy as np
import pytest
import torch

from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine import build
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.rl.rewards import REWARDS, RewardError, build_reward, register_reward
from tests.reward_models import write_tiny_clip_dir
from tests.unit.test_learned_rewards import _images, _pil, _processor
from tests.once import once_per_process

transformers = pytest.importorskip("transformers")

if "source_brightness_for_tests" not in REWARDS:
    @register_reward("source_brightness_for_tests")
    def _source_brightness(images, prompts, *, reference_images=None):
        """How much brighter a sample is than its source."""
        return images.mean(dim=(1, 2, 3)) - reference_images.mean(dim=(1, 2, 3))


@pytest.fixture(scope="module")
@once_per_process
def clip_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    write_tiny_clip_dir(root)
    return str(root)


def test_clip_consistency_is_the_cosine_of_clip_image_embeddings(clip_dir):
    images = _images(sizes=((224, 224),) * 3, seed=1)
    sources = _images(sizes=((224, 224),) * 3, seed=2)
    model = transformers.CLIPModel.from_pretrained(clip_dir).eval()
    processor = _processor({"clip": clip_dir})
    with torch.no_grad():
        def embed(batch):
            pixels = processor(images=[_pil(i) for i in batch], return_tensors="pt")["pixel_values"]
            features = model.get_image_features(pixel_values=pixels).pooler_output.double()
            return features / features.norm(dim=-1, keepdim=True)
        expected = (embed(images) * embed(sources)).sum(-1)
    reward = build_reward("clip_consistency", path=clip_dir)
    assert reward.needs_reference_images
    got = reward(torch.stack(images), ["a", "b", "c"], reference_images=torch.stack(sources))
    torch.testing.assert_close(got.double(), expected, rtol=1e-3, atol=1e-5)
    same = reward(torch.stack(images), ["a", "b", "c"], reference_images=torch.stack(images))
    torch.testing.assert_close(same, torch.ones(3), rtol=1e-5, atol=1e-5)  # an unedited copy scores 1
    with pytest.raises(RewardError, match="set data.images=true"):
        reward(torch.stack(images), ["a", "b", "c"])


def test_first_frame_consistency_is_psnr_of_the_first_frame():
    gen = torch.Generator().manual_seed(0)
    videos = torch.rand(2, 3, 5, 16, 12, generator=gen)
    sources = (videos[:, :, 0] + 0.05 * torch.randn(2, 3, 16, 12, generator=gen)).clamp(0, 1)
    reward = build_reward("first_frame_consistency")  # frames: first (the default)
    got = reward(videos, ["x", "y"], reference_images=sources)
    a, b = videos[:, :, 0].double().numpy(), sources.double().numpy()
    expected = 10 * np.log10(1.0 / ((a - b) ** 2).reshape(2, -1).mean(axis=1))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    assert float(reward(videos, ["x", "y"], reference_images=videos[:, :, 0])[0]) == pytest.approx(100.0)
    # with frames: mean every frame is compared with the source, and the PSNRs averaged per video
    every = build_reward("first_frame_consistency", frames="mean")(videos, ["x", "y"], reference_images=sources)
    per_frame = [10 * np.log10(1.0 / ((videos[:, :, k].double().numpy() - b) ** 2).reshape(2, -1).mean(axis=1))
                 for k in range(5)]
    np.testing.assert_allclose(every.numpy(), np.mean(per_frame, axis=0), rtol=1e-5)


def test_reference_images_reach_only_the_rewards_that_declare_them():
    images, sources = torch.full((2, 3, 4, 4), 0.75), torch.tensor([0.25, 0.5]).view(2, 1, 1, 1).expand(2, 3, 4, 4)
    weighted = build_reward("weighted", weights={"source_brightness_for_tests": 2.0, "jpeg_compressibility": 0.0})
    assert weighted.needs_reference_images and not build_reward("jpeg_compressibility").needs_reference_images
    torch.testing.assert_close(weighted(images, ["a", "b"], None, sources), torch.tensor([1.0, 0.5]))
    components, total = weighted.fn.scored_components(images, ["a", "b"], None, sources)
    torch.testing.assert_close(components[:, 0], torch.tensor([0.5, 0.25]))
    with pytest.raises(ValueError, match="reference_images must be a \\(2, 3, H, W\\)"):
        build_reward("source_brightness_for_tests")(images, ["a", "b"], reference_images=sources[:1])


def test_a_reward_that_needs_the_source_is_refused_without_images(tmp_path):
    config = load_config("yaml_configs/tiny/flux.yaml", ["reward.name=first_frame_consistency"])
    with pytest.raises(UserError, match="reward 'first_frame_consistency' compares each sample with its "
                                        "conditioning image: set data.images=true"):
        build.build_data_parts(config, *build.policy_hyper(config), torch.device("cpu"))
    with pytest.raises(UserError, match="data.images=true: model.family=sd3 takes no conditioning image"):
        sd3 = load_config("yaml_configs/tiny/sd3.yaml", ["data.images=true"])
        build.build_data_parts(sd3, *build.policy_hyper(sd3), torch.device("cpu"))


@pytest.mark.slow
def test_the_reward_bridge_hands_each_sample_its_source_in_the_foreground_and_the_background(clip_dir):
    """RewardBridge: the conditioning image of each sample's prompt reaches the weighted reward's consistency
    component, the same through ``submit`` (reward.async_scoring), and each captured sample keeps its source."""
    from leangrpo_mcore.data.prompts import PromptDataset
    from leangrpo_mcore.data.vae import build_vae
    from leangrpo_mcore.engine.output.samples import to_uint8
    from leangrpo_mcore.engine.reward_bridge import RewardBridge

    options = {"clip_consistency": {"path": clip_dir}, "clip_score": {"path": clip_dir}}
    config = load_config("yaml_configs/flux_kontext/tiny_edit.yaml",
                         [f"reward.options.reward_options.{k}.path={clip_dir}" for k in options])
    reward = build_reward("weighted", weights={"clip_consistency": 0.2, "clip_score": 0.8}, reward_options=options)
    decoder = build_vae("tiny", "flux", latent_channels=4, spatial_factor=8, seed=0)
    dataset = PromptDataset(["make the square red", "remove the circle"])
    bridge = RewardBridge(build.DataParts(dataset, None, None, decoder, reward), config)
    gen = torch.Generator().manual_seed(0)
    sources = {0: torch.rand(3, 32, 32, generator=gen), 1: torch.rand(3, 32, 32, generator=gen)}
    latents, ids = torch.randn(3, 4, 16, generator=gen), torch.tensor([1, 0, 1])
    bridge.begin_step(True, sources)
    now = bridge(latents, ids)
    kept = bridge.samples
    bridge.begin_step(True, sources)
    later = bridge.submit(latents, ids).result()
    bridge.close()
    assert torch.equal(now, later) and bridge.error is None
    assert all(np.array_equal(item[5], to_uint8(sources[item[3]][None])[0]) for item in kept)
    images = decoder.decode(latents, height=32, width=32).images
    expected = reward(images, [dataset[i] for i in ids.tolist()], None, torch.stack([sources[i] for i in ids.tolist()]))
    torch.testing.assert_close(now, expected)
    swapped = reward(images, [dataset[i] for i in ids.tolist()], None, torch.stack([sources[1 - i] for i in ids.tolist()]))
    assert not torch.equal(now, swapped)  # the right source reached each sample
