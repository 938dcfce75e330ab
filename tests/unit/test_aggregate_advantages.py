"""``reward.aggregate: advantages``: one group advantage per component reward, A = clamp(Σ_k w_k A_k).

The step engine's advantages must be the float64 formula of its (P, M, K) component rewards; Retain must stay
bitwise equal to Native and Reweight within the fp32 floor (its affine accumulation and global-std fold fall back
to per-sample buffers); the reported rewards are the weighted sum; the gradient differs from summing the rewards
first; async scoring carries the components bit for bit; and the trainer logs each component's mean and refuses
the combinations that make no sense, and stops in one line when a component reward fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from leangrpo_mcore.schedules import plan_reweight
from tests.unit.test_schedules_parity import (  # noqa: F401 -- _one_thread: the autouse fixture
    Case, _one_thread, _reward, bitwise, check_parity, rel_l2, run_case)

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = (1.0, 0.5)
FLUX = Case(family="flux", reward_weights=WEIGHTS)
DDOF_EPS = {"flow_grpo": (0, 1e-4), "dance_grpo": (1, 1e-8)}




def two_rewards(final: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """(B, 2) component rewards of two scales: the parity tests' linear read-out (order 1) and a small
    nonlinear one in (0, 1), with a group spread far below the first's, that ranks the samples differently."""
    fine = torch.tanh(final.flatten(1)[:, ::3]).pow(2).mean(1)
    return torch.stack([_reward(final, prompt_ids), fine], dim=1)


def summed_reward(final: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """aggregate=rewards on the same components: one reward w_0 r_0 + w_1 r_1 (float64 sum, float32)."""
    both = two_rewards(final, prompt_ids).double()
    return (WEIGHTS[0] * both[:, 0] + WEIGHTS[1] * both[:, 1]).float()


def reference_advantages(components: np.ndarray, weights, *, kind: str = "flow_grpo", global_std: bool = False,
                         clip=None) -> np.ndarray:
    """(P, M) float64: per component (r − group mean) / (std + eps) with the estimator's ddof (std over the whole
    step with global std), weighted sum over components, then the clamp."""
    ddof, eps = DDOF_EPS[kind]
    values = components.astype(np.float64)
    total = np.zeros(values.shape[:2])
    for k, weight in enumerate(weights):
        column = values[..., k]
        std = np.std(column, ddof=ddof) if global_std else np.std(column, axis=1, ddof=ddof, keepdims=True)
        total += weight * (column - column.mean(axis=1, keepdims=True)) / (std + eps)
    return total if clip is None else np.clip(total, -clip, clip)


def _check_engine_numbers(out, case: Case) -> None:
    """The step's advantages are the formula of its component rewards; its rewards their weighted sum."""
    assert out.components.shape == (case.prompts, case.group_size, 2)
    assert np.all(out.components.std(axis=1) > 0)  # both components spread within every group
    expected = reference_advantages(out.components, WEIGHTS, kind=case.advantage, global_std=case.global_std,
                                    clip=case.adv_clip_max)
    np.testing.assert_allclose(out.advantages, expected, rtol=1e-5, atol=1e-6)
    weighted = (WEIGHTS[0] * out.components[..., 0].astype(np.float64)
                + WEIGHTS[1] * out.components[..., 1].astype(np.float64)).astype(np.float32)
    assert np.array_equal(out.rewards, weighted)


def _run_three(case: Case):
    return tuple(run_case(case.but(schedule=name), reward_fn=two_rewards) for name in ("native", "retain", "reweight"))


def test_flux_schedules_agree_and_differ_from_summing_the_rewards():
    native, retain, reweight = _run_three(FLUX)
    _check_engine_numbers(native, FLUX)
    check_parity(native, retain, reweight)
    assert reweight.buffers == 4  # one provisional gradient per sample of the group
    affine = run_case(FLUX.but(schedule="reweight", accumulate="affine"), reward_fn=two_rewards)
    assert affine.buffers == 4  # affine accumulation fell back to per-sample buffers
    assert rel_l2(native.grads[0], affine.grads[0]) < 1e-6
    summed = run_case(Case(family="flux"), reward_fn=summed_reward)
    assert np.array_equal(summed.rewards, native.rewards) and np.array_equal(summed.trajectory, native.trajectory)
    assert rel_l2(native.grads[0], summed.grads[0]) > 1e-2  # the feature changes the gradient
    # the coarse reward dominates the summed one: its advantage is nearly the coarse component's alone
    coarse_only = reference_advantages(native.components[..., :1], (1.0,), clip=5.0)
    assert np.abs(summed.advantages - coarse_only).max() < 0.05
    assert np.abs(native.advantages - coarse_only).max() > 0.2


def test_wan_global_std_clamp_kl_micro_batch():
    """Global std per component, a clamp that fires after the sum, the KL accumulator and per-sample forwards."""
    case = Case(family="wan", lora=True, kl_beta=20.0, global_std=True, adv_clip_max=1.0, micro_batch=2,
                accumulate="affine", reward_weights=WEIGHTS)
    native, retain, reweight = _run_three(case)
    _check_engine_numbers(native, case)
    unclamped = reference_advantages(native.components, WEIGHTS, global_std=True)
    assert np.abs(unclamped).max() > 1.0  # the clamp fires
    check_parity(native, retain, reweight, per_sample=True, tol=1.5e-6)  # measured 3.3e-7


def test_dance_grpo_two_updates():
    case = Case(family="wan", advantage="dance_grpo", updates=2, group_size=3, reward_weights=WEIGHTS)
    native, retain, reweight = _run_three(case)
    _check_engine_numbers(native, case)
    check_parity(native, retain, reweight, tol=4e-6)  # measured 8.4e-7 (second update)


@pytest.mark.parametrize("schedule", ["native", "reweight"])
def test_async_scoring_carries_the_components_bitwise(schedule):
    case = FLUX.but(schedule=schedule, global_std=True)
    sync = run_case(case, reward_fn=two_rewards)
    background = run_case(case.but(async_scoring=True), reward_fn=two_rewards)
    assert np.array_equal(sync.components, background.components)
    assert np.array_equal(sync.advantages, background.advantages)
    assert all(bitwise(a, b) for a, b in zip(sync.grads, background.grads))
    assert bitwise(sync.params, background.params)


def test_reward_fn_must_return_the_components():
    with pytest.raises(ValueError, match=r"reward_fn must return shape \(1, 2\), got \(1,\)"):
        run_case(FLUX.but(prompts=1), reward_fn=summed_reward)


def test_reweight_plan_falls_back_with_a_note():
    options = dict(advantage="flow_grpo", group_size=4, prompts_per_step=2, adv_clip_max=5.0)
    plan = plan_reweight("affine", **options, global_std=True, aggregate="advantages")
    assert (plan.accumulate, plan.global_fold, plan.global_std) == ("per_sample", False, True)
    assert "reward.aggregate=advantages" in plan.note and "affine accumulation and the global-std fold" in plan.note
    assert plan_reweight("affine", **options, global_std=True).global_fold  # the one-reward plan folds
    plain = plan_reweight("per_sample", **options, global_std=False, aggregate="advantages")
    assert (plain.accumulate, plain.note) == ("per_sample", "")
    with pytest.raises(ValueError, match="unknown reward aggregation 'sum'"):
        plan_reweight("per_sample", **options, global_std=False, aggregate="sum")


# ---------------------------------------------------------------------------------------------- the trainer

def brightness_for_tests(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """A cheap deterministic reward on another scale than JPEG compressibility: 10 × the mean pixel."""
    return 10.0 * images.mean(dim=(1, 2, 3))


PLUGIN = "tests.unit.test_aggregate_advantages:brightness_for_tests"


def _config(tmp_path: Path, accumulate: str = "per_sample", **reward) -> str:
    config = yaml.safe_load((ROOT / "yaml_configs" / "tiny" / "flux.yaml").read_text())
    config["reward"] = reward
    config["schedule"]["reweight_accumulate"] = accumulate
    config["train"].update(output_dir=str(tmp_path / "run"), max_steps=1)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _main(capsys, path: str):
    from leangrpo_mcore.cli.train import main

    code = main(["--config", path])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    return code, errors, captured.err + captured.out


def test_trainer_logs_each_component_mean(capsys, tmp_path):
    weights = {"jpeg_compressibility": 1.0, PLUGIN: 0.5}
    rows = []
    for background in (False, True):  # the reward bridge's call, and its submit (reward.async_scoring)
        path = _config(tmp_path / str(background), "affine", name="weighted", weights=weights,
                       aggregate="advantages", async_scoring=background)
        code, errors, output = _main(capsys, path)
        assert code == 0 and not errors, output
        rows.append(json.loads((tmp_path / str(background) / "run" / "metrics.jsonl").read_text().splitlines()[0]))
        # Reweight's plan says why it keeps per-sample buffers
        assert "Reweight accumulates per_sample" in output and "reward.aggregate=advantages: A = " in output
    row = rows[0]
    jpeg, bright = row["reward_jpeg_compressibility_mean"], row[f"reward_{PLUGIN}_mean"]
    assert 1.0 < bright < 9.0 and jpeg < 0  # 10 × a mean pixel in (0, 1); minus kilobytes of JPEG
    assert row["reward_mean"] == pytest.approx(jpeg + 0.5 * bright, rel=1e-6)
    same = ("reward_mean", "reward_std", "reward_jpeg_compressibility_mean", f"reward_{PLUGIN}_mean", "loss",
            "grad_norm", "advantage_abs_mean")
    assert [rows[1][key] for key in same] == [row[key] for key in same]


def test_refused_combinations_are_one_line(capsys, tmp_path):
    for reward, expected in (
        (dict(name="jpeg_compressibility", aggregate="advantages"),
         "reward.aggregate=advantages needs reward.name=weighted"),
        (dict(name="weighted", weights={"jpeg_compressibility": 1.0}, normalize=True, aggregate="advantages"),
         "set reward.normalize=false"),
        (dict(name="weighted", weights={"jpeg_compressibility": 1.0}, aggregate="sum"), "reward.aggregate"),
    ):
        code, errors, output = _main(capsys, _config(tmp_path, **reward))
        assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
        assert expected in errors[0] and "reward.aggregate" in errors[0], errors[0]


def nan_for_tests(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """A broken component reward."""
    return torch.full((images.shape[0],), float("nan"))


@pytest.mark.parametrize("background", [False, True])
def test_a_failing_component_stops_the_run_in_one_line(capsys, tmp_path, background):
    weights = {"jpeg_compressibility": 1.0, "tests.unit.test_aggregate_advantages:nan_for_tests": 0.5}
    path = _config(tmp_path, name="weighted", weights=weights, aggregate="advantages", async_scoring=background)
    code, errors, output = _main(capsys, path)
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert "nan_for_tests' returned 1 non-finite values" in errors[0], errors[0]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""
