"""Wan2.2-TI2V's VAE compresses 16x per side: the trainer samples, decodes and validates on that grid.

The runs go through ``leangrpo-train`` on the tiny Wan config widened to Wan2.2's 48 latent channels, so the
latent grid is the one the step engine builds and the images are the ones the reward sees after decoding.
"""

from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.engine import build

ROOT = Path(__file__).resolve().parents[2]
TINY_WAN = str(ROOT / "yaml_configs" / "tiny" / "wan.yaml")
WAN22 = ("model.arch.in_channels=48", "model.arch.out_channels=48")
SEEN: list[tuple[int, ...]] = []


def image_shapes(images, prompts):
    """A reward plugin that records the shape of the decoded images it scores."""
    SEEN.append(tuple(images.shape))
    return images.mean(dim=(1, 2, 3))


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _train(tmp_path, *overrides):
    return main(["--config", TINY_WAN, f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1",
                 "checkpoint.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
                 "reward.name=tests.unit.test_wan22_latents:image_shapes", *overrides])


def test_wan22_samples_a_16x_latent_grid_and_decodes_to_the_requested_size(tmp_path, monkeypatch):
    engines = []
    real = build.build_engine

    def capture(*args, **kwargs):
        engines.append(real(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(build, "build_engine", capture)
    SEEN.clear()
    assert _train(tmp_path, *WAN22, "sampler.height=64", "sampler.width=96", "sampler.frames=5") == 0
    assert engines[0].plan.latent_shape == (48, 2, 4, 6)  # (C, (5 - 1)/4 + 1, 64/16, 96/16)
    assert SEEN and all(shape[1:] == (3, 64, 96) for shape in SEEN)


def test_wan21_keeps_the_8x_grid(tmp_path, monkeypatch):
    engines = []
    real = build.build_engine
    monkeypatch.setattr(build, "build_engine", lambda *a, **k: engines.append(real(*a, **k)) or engines[-1])
    SEEN.clear()
    assert _train(tmp_path, "sampler.height=48", "sampler.width=32") == 0
    assert engines[0].plan.latent_shape == (4, 1, 6, 4)
    assert SEEN and all(shape[1:] == (3, 48, 32) for shape in SEEN)


def test_wan22_resolution_must_be_a_multiple_of_32(tmp_path, capsys):
    assert _train(tmp_path, *WAN22, "sampler.height=48", "sampler.width=64") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "multiples of 32" in errors[0] and "48x64" in errors[0], errors[0]
