"""Evaluation at world size 2 equals world size 1: samples split over FSDP2 data-parallel ranks (with padding when
they do not divide), and the policy split by tensor, context and pipeline parallelism."""

from pathlib import Path

import numpy as np
import pytest
import torch

from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.eval_run import evaluate_model
from leangrpo_mcore.rl.rewards import REWARDS, register_reward
from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
# 5 samples: a data-parallel split of 3 + 2 pads the second rank
EVAL = ["eval.num_prompts=5", "eval.samples_per_prompt=1", "eval.rewards=[{name: mean_intensity_for_eval_tests}]"]
LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2"], "cp2": ["parallel.cp=2"], "pp2": ["parallel.pp=2"],
           "sde": ["eval.noise_level=0.5"]}


def _register() -> None:
    if "mean_intensity_for_eval_tests" not in REWARDS:
        @register_reward("mean_intensity_for_eval_tests")
        def _mean_intensity(images, prompts):
            return images.mean(dim=(1, 2, 3))


def _evaluate(overrides: list[str]) -> dict:
    _register()
    torch.set_num_threads(1)
    result = evaluate_model(load_config(TINY_FLUX, EVAL + overrides))
    return None if result is None else result.rewards["mean_intensity_for_eval_tests"]


def _ranks(rank, world_size):
    return {name: _evaluate(extra) for name, extra in LAYOUTS.items()}


def test_eval_at_world_size_2_equals_world_size_1():
    single = {"dp2": _evaluate([]), "sde": _evaluate(LAYOUTS["sde"])}
    results = run_ranks(_ranks, 2, timeout=400)
    assert all(value is None for value in results[1].values())  # the result is the first rank's
    for name, stats in results[0].items():
        reference = single["sde" if name == "sde" else "dp2"]
        np.testing.assert_allclose(stats["per_prompt"], reference["per_prompt"], rtol=1e-5, err_msg=name)
        assert len(stats["per_prompt"]) == 5
    assert single["sde"]["mean"] != pytest.approx(single["dp2"]["mean"], rel=1e-6)  # SDE noise reaches the rollout
