"""The SDE window's schedules (fixed, random, progressive), MixGRPO-Flash's compression after it, and the one-line
errors of settings that cannot work together."""

from fractions import Fraction

import pytest
import torch

from leangrpo_mcore.config import ConfigError, build_config, load_config
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.diffusion.window import SDEWindow, compress_after_window, compressed_indices, window_error
from leangrpo_mcore.errors import UserError


def _mixgrpo_starts(low: int, high: int, stride: int, every: int, iterations: int) -> list[int]:
    """MixGRPO's progressive strategy as it runs: after each iteration count it, every ``every`` iterations move
    the start by ``stride``, and past the last start roll back to the first."""
    cur, count, starts = low, 0, []
    for _ in range(iterations):
        starts.append(cur)
        count += 1
        if count == every:
            count, cur = 0, cur + stride
        if cur >= high:
            cur, count = low, 0
    return starts


@pytest.mark.parametrize("low, high, stride, every", [(0, 5, 2, 3), (0, 21, 1, 20), (2, 6, 1, 1), (1, 4, 5, 2)])
def test_progressive_window_moves_and_wraps_as_mixgrpo(low, high, stride, every):
    window = SDEWindow(size=4, low=low, high=high, schedule="progressive", stride=stride, shift_every=every)
    iterations = 3 * every * len(range(low, high, stride)) + 5
    assert [window.start(k) for k in range(iterations)] == _mixgrpo_starts(low, high, stride, every, iterations)


def test_fixed_random_and_no_window():
    assert [SDEWindow(size=2, low=3, high=5, schedule="fixed").start(k) for k in range(4)] == [3] * 4
    assert SDEWindow(size=2, low=0, high=5).start(7) is None  # random: drawn per prompt group
    assert SDEWindow(size=0, schedule="progressive").start(3) is None


def test_the_window_counts_optimizer_steps_before_the_rollout():
    """Training steps count from 1; K updates per rollout are K optimizer steps each."""
    from leangrpo_mcore.engine.step import StepPlan

    window = SDEWindow(size=1, low=0, high=4, schedule="progressive", stride=1, shift_every=2)
    plan = StepPlan(schedule="native", group_size=2, prompts_per_step=2, latent_shape=(4,),
                    sigmas=get_sigmas("sd3", 5), sde=None, objective=None, updates_per_rollout=2, window=window,
                    selection={"method": "sde_window", "fraction": 1.0, "window_size": 1, "window_range": (0, 4)})
    # optimizer steps before steps 1, 2, 3, 4, 5: 0, 2, 4, 6, 8 -> positions 0, 1, 2, 3, 0
    assert [plan.window_start(step) for step in range(1, 6)] == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("steps, end, k", [(10, 3, 3), (25, 4, 8), (25, 23, 1), (7, 2, 4), (6, 3, 2)])
def test_compression_keeps_the_window_and_spreads_k_steps_over_the_rest(steps, end, k):
    indices = compressed_indices(steps, end, k)
    remaining = steps - end
    expected_tail = [end + int(Fraction(j * remaining, k) + Fraction(1, 2)) for j in range(1, k + 1)]
    assert indices == list(range(end + 1)) + expected_tail
    assert len(indices) == end + k + 1 and indices[-1] == steps
    sigmas = get_sigmas("sd3", steps, shift=3.0)
    compressed = compress_after_window(sigmas, end, k)
    assert torch.equal(compressed[: end + 1], sigmas[: end + 1]) and float(compressed[-1]) == 0.0
    assert bool((compressed[1:] < compressed[:-1]).all())


def test_nothing_to_compress():
    assert compressed_indices(6, 4, 2) == list(range(7))  # two steps left, two asked for
    assert compressed_indices(6, 4, 0) == list(range(7))  # compression off
    assert compressed_indices(6, 6, 3) == list(range(7))  # the window ends the rollout


@pytest.mark.parametrize("settings, key", [
    (dict(size=0, schedule="progressive"), "sampler.sde_window_schedule=progressive"),
    (dict(size=0, ode_solver="dpmpp_2m"), "sampler.ode_solver=dpmpp_2m"),
    (dict(size=0, ode_steps_after=3), "sampler.ode_steps_after_window=3"),
    (dict(size=2, ode_steps_after=2), "sampler.ode_steps_after_window needs a shared window"),
    (dict(size=2, schedule="progressive", stride=0), "sampler.window_stride=0"),
    (dict(size=2, schedule="progressive", shift_every=0), "sampler.window_shift_every=0"),
    (dict(size=4, schedule="fixed", low=4, high=6), "sampler.sde_window_range=[4, 6]"),
])
def test_settings_that_cannot_work_are_one_line_errors_naming_the_key(settings, key):
    args = dict(size=2, low=0, high=2, schedule="random", stride=1, shift_every=1, ode_steps_after=0,
                ode_solver="euler", num_steps=6)
    args.update(settings)
    message = window_error(**args)
    assert message is not None and key in message and "\n" not in message
    solver = args.pop("ode_solver")
    args.pop("num_steps")
    with pytest.raises(UserError, match=key.replace("[", r"\[")):
        SDEWindow(**args).check(6, solver)


def test_good_settings_pass():
    SDEWindow(size=4, low=0, high=20, schedule="progressive", shift_every=20, ode_steps_after=8).check(25, "dpmpp_2m")
    SDEWindow(size=3, low=0, high=3).check(6, "dpmpp_2m")
    SDEWindow(size=0).check(6)


@pytest.mark.parametrize("override, key", [
    ("sampler.window_stride=0", "sampler.window_stride"),
    ("sampler.window_shift_every=0", "sampler.window_shift_every"),
    ("sampler.ode_solver=heun", "sampler.ode_solver"),
    ("sampler.sde_window_schedule=sliding", "sampler.sde_window_schedule"),
    ("sampler.ode_steps_after_window=-1", "sampler.ode_steps_after_window"),
])
def test_the_config_refuses_out_of_range_values_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("yaml_configs/tiny/flux.yaml", [override])


def test_the_config_refuses_a_window_setting_before_any_heavy_work():
    with pytest.raises(ConfigError, match=r"^sampler.ode_solver=dpmpp_2m needs an SDE window"):
        build_config({"sampler": {"ode_solver": "dpmpp_2m"}})
    with pytest.raises(ConfigError, match=r"^sampler.sde_window_range=\[4, 6\]"):
        build_config({"sampler": {"num_steps": 6, "sde_window_size": 3, "sde_window_range": [4, 6]}})
    assert build_config({"sampler": {"sde_window_size": 2, "sde_window_schedule": "progressive"}}).sampler.ode_solver == "euler"
