import importlib.util
import io
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from leangrpo_mcore.errors import MissingExtraError, require_extra
from leangrpo_mcore.rl.rewards import (
    REWARDS,
    RewardError,
    WeightedReward,
    available_rewards,
    build_reward,
    extract_quoted_text,
    levenshtein,
    ocr_text_score,
    register_reward,
)

HAS_RAPIDOCR = all(importlib.util.find_spec(name) is not None for name in ("rapidocr", "onnxruntime"))


def _smooth_and_noisy(size=64):
    ramp = torch.linspace(0, 1, size)
    smooth = torch.stack([ramp.expand(size, size), ramp.expand(size, size).T, torch.full((size, size), 0.5)])
    noisy = torch.rand(3, size, size, generator=torch.Generator().manual_seed(0))
    return torch.stack([smooth, noisy])


@pytest.fixture
def temp_reward():
    """Register throw-away rewards by name; unregister them afterwards."""
    added = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)

    yield add
    for name in added:
        REWARDS.pop(name)


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "ocr", "weighted"} <= set(available_rewards())
    with pytest.raises(ValueError, match="unknown reward 'jpg'; valid: .*jpeg_compressibility"):
        build_reward("jpg")
    with pytest.raises(ValueError, match="bad options"):
        build_reward("jpeg_compressibility", qualty=90)


def test_jpeg_matches_pil_and_orders_smooth_vs_noisy():
    images = _smooth_and_noisy()
    direct = []
    for img in images:
        pixels = (img * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
        direct.append(len(buf.getvalue()) / 1000)
    incompress = build_reward("jpeg_incompressibility")(images, ["a", "b"])
    compress = build_reward("jpeg_compressibility")(images, ["a", "b"])
    assert incompress.dtype == torch.float32
    np.testing.assert_allclose(incompress.numpy(), direct, rtol=1e-6)
    np.testing.assert_allclose(compress.numpy(), -np.array(direct), rtol=1e-6)
    assert incompress[1] > 3 * incompress[0]  # noise costs far more bytes than a smooth ramp
    lower_quality = build_reward("jpeg_incompressibility", quality=50)(images, ["a", "b"])
    assert bool((lower_quality < incompress).all())


def test_weighted_sum_and_normalisation(temp_reward):
    temp_reward("_mean_pixel", lambda images, prompts: images.mean(dim=(1, 2, 3)))
    images = _smooth_and_noisy()
    parts = {
        "jpeg_incompressibility": build_reward("jpeg_incompressibility")(images, ["a", "b"]),
        "_mean_pixel": images.mean(dim=(1, 2, 3)),
    }
    weighted = build_reward("weighted", weights={"jpeg_incompressibility": 0.5, "_mean_pixel": -2.0})
    expected = 0.5 * parts["jpeg_incompressibility"] - 2.0 * parts["_mean_pixel"]
    torch.testing.assert_close(weighted(images, ["a", "b"]), expected)

    normed = build_reward("weighted", weights={"jpeg_incompressibility": 1.0, "_mean_pixel": 3.0}, normalize=True)
    z = {k: (v.double() - v.double().mean()) / (v.double().std(correction=0) + 1e-8) for k, v in parts.items()}
    expected_norm = (z["jpeg_incompressibility"] + 3.0 * z["_mean_pixel"]).float()
    torch.testing.assert_close(normed(images, ["a", "b"]), expected_norm)
    assert isinstance(normed.fn, WeightedReward)

    options = {"jpeg_incompressibility": {"quality": 50}}
    low_q = build_reward("weighted", weights={"jpeg_incompressibility": 1.0}, reward_options=options)
    assert bool((low_q(images, ["a", "b"]) < parts["jpeg_incompressibility"]).all())
    with pytest.raises(ValueError, match="without a weight: ocr"):
        build_reward("weighted", weights={"_mean_pixel": 1.0}, reward_options={"ocr": {}})
    with pytest.raises(ValueError, match="finite"):
        build_reward("weighted", weights={"_mean_pixel": float("nan")})


def test_bad_rewards_raise_reward_error(temp_reward):
    def nan_reward(images, prompts):
        out = torch.ones(images.shape[0])
        out[1:] = float("nan")
        return out

    def broken(images, prompts):
        raise RuntimeError("lost the model\nsecond line")

    temp_reward("_nan", nan_reward)
    temp_reward("_broken", broken)
    temp_reward("_shape", lambda images, prompts: torch.zeros(images.shape[0], 1))
    temp_reward("_list", lambda images, prompts: [0.0] * images.shape[0])
    images = torch.rand(3, 3, 8, 8)
    prompts = ["a", "b", "c"]
    with pytest.raises(RewardError, match=r"^reward '_nan' returned 2 non-finite values$"):
        build_reward("_nan")(images, prompts)
    with pytest.raises(RewardError, match=r"^reward '_broken' raised RuntimeError: lost the model$"):
        build_reward("_broken")(images, prompts)
    with pytest.raises(RewardError, match=r"returned shape \(3, 1\), expected \(3,\)"):
        build_reward("_shape")(images, prompts)
    with pytest.raises(RewardError, match="returned list"):
        build_reward("_list")(images, prompts)
    with pytest.raises(RewardError, match="reward '_nan'"):
        build_reward("weighted", weights={"jpeg_compressibility": 1.0, "_nan": 1.0})(images, prompts)
    with pytest.raises(ValueError, match="3 strings"):
        build_reward("jpeg_compressibility")(images, ["a"])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        build_reward("jpeg_compressibility")(torch.rand(3, 8, 8), prompts)


def test_quoted_text_and_levenshtein():
    assert extract_quoted_text('A neon sign saying "Open 24 Hours" at night') == "Open 24 Hours"
    assert extract_quoted_text("the dog's poster reads 'BEWARE' in red") == "BEWARE"
    assert extract_quoted_text("it's 'x' and \"y\"") == "y"
    assert extract_quoted_text("no quotes, isn't it") is None
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("flaw", "lawn") == 2 and levenshtein("same", "same") == 0
    assert ocr_text_score("Hello World", "hello world") == 1.0
    assert ocr_text_score("xxhelloworldyy", "Hello World") == 1.0  # a substring counts as read
    assert ocr_text_score("helo world", "hello world") == pytest.approx(1 - 1 / 10)
    assert ocr_text_score("completely unrelated long text", "abc") == 0.0  # distance capped at len(target)
    with pytest.raises(ValueError, match="empty"):
        ocr_text_score("abc", "   ")


def test_ocr_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr", None)
    with pytest.raises(MissingExtraError) as err:
        build_reward("ocr")
    assert str(err.value) == "reward.name=ocr needs the 'ocr' extra: pip install 'leangrpo_mcore[ocr]'"
    assert require_extra("json", "none", "x").dumps([1]) == "[1]"
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtraError, match=r"^feature needs the 'text' extra: pip install 'leangrpo_mcore\[text\]'$"):
        require_extra("transformers", "text", "feature")


def _render(text):
    font = ImageFont.load_default(size=40)
    image = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(image).text((12, 22), text, fill="black", font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.mark.skipif(not HAS_RAPIDOCR, reason="rapidocr and onnxruntime (the 'ocr' extra) are not installed")
def test_ocr_reads_rendered_text():
    reward = build_reward("ocr")
    text = _render("Hello World")
    images = torch.stack([text, text, torch.ones(3, 96, 320)])
    prompts = ['a sign that says "hello world"', 'a sign that says "Goodbye Moon"', 'a blank card with "Hi"']
    values = reward(images, prompts)
    assert values[0].item() == 1.0
    assert values[1].item() < 0.5
    assert values[2].item() == 0.0  # nothing read: the distance is capped at len(target)
    with pytest.raises(RewardError, match="reward 'ocr' raised ValueError: prompt has no quoted text"):
        reward(images[:1], ["no quote here"])
    zero = build_reward("ocr", missing_target="zero")
    assert zero.fn.engine is not None and zero(images[:1], ["no quote here"]).item() == 0.0
