import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from leangrpo_mcore.diffusion import (
    dance_sigmas,
    flux_mu,
    flux_sigmas,
    get_sigmas,
    qwen_image_sigmas,
    sd3_sigmas,
    timesteps_from_sigmas,
    transformer_timestep,
    wan_sigmas,
)


def _diffusers_flux(num_steps, image_seq_len):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15))
    return scheduler


def _diffusers_static(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler


def _common_checks(sigmas, num_steps):
    assert sigmas.dtype == torch.float32
    assert sigmas.shape == (num_steps + 1,)
    assert sigmas[0].item() == 1.0
    assert sigmas[-1].item() == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())


@pytest.mark.parametrize("num_steps,image_seq_len", [(6, 1024), (16, 4096), (10, 256), (28, 700), (1, 64)])
def test_flux_matches_diffusers_scheduler(num_steps, image_seq_len):
    ours = flux_sigmas(num_steps, image_seq_len)
    scheduler = _diffusers_flux(num_steps, image_seq_len)
    _common_checks(ours, num_steps)
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=1e-6, atol=0)
    # FluxPipeline feeds the transformer timestep / 1000 with timestep = scheduler.timesteps[i].
    torch.testing.assert_close(timesteps_from_sigmas(ours, "flux")[:-1], scheduler.timesteps, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        transformer_timestep(timesteps_from_sigmas(ours, "flux")[:-1], "flux"),
        scheduler.timesteps.to(torch.float32) / 1000,
        rtol=1e-6,
        atol=0,
    )
    # With bf16 latents the pipeline rounds the timestep to bf16 before dividing.
    ours_bf16 = transformer_timestep(timesteps_from_sigmas(ours, "flux")[:-1], "flux", dtype=torch.bfloat16)
    assert ours_bf16.dtype == torch.bfloat16
    assert torch.equal(ours_bf16, scheduler.timesteps.to(torch.bfloat16) / 1000)


def test_flux_closed_form_float64():
    num_steps, seq = 6, 1024
    mu = 0.5 + (1.15 - 0.5) * (seq - 256) / (4096 - 256)
    assert flux_mu(seq) == pytest.approx(mu, rel=1e-12)
    t = np.linspace(1.0, 1 / num_steps, num_steps)
    expected = np.append(math.exp(mu) / (math.exp(mu) + (1 / t - 1)), 0.0)
    np.testing.assert_allclose(flux_sigmas(num_steps, seq).numpy(), expected, rtol=1e-6, atol=0)
    # FLUX T=6 at 512² (1024 tokens): mu = 0.63, sigma_1 = e^0.63 / (e^0.63 + 0.2) = 0.903736.
    assert flux_sigmas(6, 1024)[1].item() == pytest.approx(0.903736, abs=1e-6)


@pytest.mark.parametrize("num_steps", [1, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sd3_matches_diffusers_scheduler(num_steps, shift):
    ours = sd3_sigmas(num_steps, shift)
    scheduler = _diffusers_static(num_steps, shift)
    _common_checks(ours, num_steps)
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=1e-6, atol=0)
    torch.testing.assert_close(timesteps_from_sigmas(ours, "sd3")[:-1], scheduler.timesteps, rtol=1e-6, atol=0)
    assert torch.equal(transformer_timestep(scheduler.timesteps, "sd3"), scheduler.timesteps)


@pytest.mark.parametrize("num_steps,shift", [(20, 3.0), (50, 5.0), (8, 7.5)])
def test_wan_matches_diffusers_scheduler(num_steps, shift):
    ours = wan_sigmas(num_steps, shift)
    scheduler = _diffusers_static(num_steps, shift)
    _common_checks(ours, num_steps)
    torch.testing.assert_close(ours, scheduler.sigmas, rtol=1e-6, atol=0)
    torch.testing.assert_close(timesteps_from_sigmas(ours, "wan")[:-1], scheduler.timesteps, rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_steps,shift", [(16, 3.0), (20, 5.0), (1, 3.0)])
def test_dance_closed_form_and_integer_timesteps(num_steps, shift):
    ours = dance_sigmas(num_steps, shift)
    _common_checks(ours, num_steps)
    t = np.linspace(1.0, 0.0, num_steps + 1)
    np.testing.assert_allclose(ours.numpy(), shift * t / (1 + (shift - 1) * t), rtol=1e-6, atol=1e-7)
    timesteps = timesteps_from_sigmas(ours, "dance")
    assert timesteps.dtype == torch.float32
    assert timesteps.tolist() == [float(int(ours[i] * 1000)) for i in range(num_steps + 1)]
    assert timesteps[0].item() == 1000.0 and timesteps[-1].item() == 0.0


def test_dance_matches_known_values():
    # shift 3, T=4: t = 1, .75, .5, .25, 0 -> 1, .9, .75, .5, 0
    torch.testing.assert_close(dance_sigmas(4, 3.0), torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), rtol=1e-6, atol=0)
    assert timesteps_from_sigmas(dance_sigmas(4, 3.0), "dance").tolist() == [1000.0, 900.0, 750.0, 500.0, 0.0]


def test_get_sigmas_dispatch():
    assert torch.equal(get_sigmas("flux", 6, image_seq_len=1024), flux_sigmas(6, 1024))
    assert torch.equal(get_sigmas("sd3", 10), sd3_sigmas(10, 3.0))
    assert torch.equal(get_sigmas("dance", 16, shift=5.0), dance_sigmas(16, 5.0))
    assert torch.equal(get_sigmas("wan", 20, shift=5.0), wan_sigmas(20, 5.0))
    assert not torch.equal(get_sigmas("wan", 20, shift=5.0), get_sigmas("wan", 20))


def test_get_sigmas_errors():
    with pytest.raises(ValueError, match="valid kinds: flux, sd3, dance, wan"):
        get_sigmas("ddim", 10)
    with pytest.raises(ValueError, match="image_seq_len"):
        get_sigmas("flux", 6)
    with pytest.raises(ValueError, match="shift=None"):
        get_sigmas("flux", 6, image_seq_len=1024, shift=3.0)
    with pytest.raises(ValueError, match="only to the flux"):
        get_sigmas("sd3", 6, image_seq_len=1024)
    with pytest.raises(ValueError, match="num_steps"):
        get_sigmas("dance", 0)
    with pytest.raises(ValueError, match="shift"):
        sd3_sigmas(10, shift=-1.0)
    with pytest.raises(ValueError, match="valid kinds"):
        timesteps_from_sigmas(dance_sigmas(4), "euler")
    with pytest.raises(ValueError, match="valid families: flux, sd3, wan"):
        transformer_timestep(torch.ones(2), "hunyuan")


QWEN_IMAGE_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
                        "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
                        "time_shift_type": "exponential", "use_dynamic_shifting": True}
"""Qwen/Qwen-Image's scheduler/scheduler_config.json (the switches that matter; the others are diffusers' defaults)."""


@pytest.mark.parametrize("num_steps,image_seq_len", [(10, 1024), (50, 4096), (6, 16), (2, 64), (3, 9000)])
def test_qwen_image_matches_the_pipeline_and_released_scheduler(num_steps, image_seq_len):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_IMAGE_SCHEDULER)
    # QwenImagePipeline: linspace sigmas, mu from the scheduler config's shift line, then the terminal stretch.
    mu = calculate_shift(image_seq_len, 256, 8192, 0.5, 0.9)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ours = qwen_image_sigmas(num_steps, image_seq_len)
    _common_checks(ours, num_steps)
    assert torch.equal(ours, scheduler.sigmas)
    assert abs(ours[-2].item() - 0.02) < 1e-7
    assert torch.equal(get_sigmas("qwen_image", num_steps, image_seq_len=image_seq_len), ours)
    assert torch.equal(transformer_timestep(timesteps_from_sigmas(ours, "qwen_image")[:-1], "qwen_image"),
                       scheduler.timesteps / 1000)
    with pytest.raises(ValueError, match="at least 2 steps"):
        qwen_image_sigmas(1, image_seq_len)
