"""Every reader of a training checkpoint verifies it first: resume, ``model.path=RUN/checkpoints/step_N``,
``leangrpo-eval --checkpoint`` and ``leangrpo-convert``. A real checkpoint (one step of the tiny FLUX run) is damaged
three ways (a flipped bit inside a weight tensor, a truncated shard, a missing ``COMPLETE``); each consumer refuses
each copy in one ``error:`` line naming the file, exit code 2, and trains, evaluates or writes nothing."""

import json
import os
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.cli.eval import main as eval_main
from leangrpo_mcore.cli.train import main as train_main
from tests.checkpoint_damage import DAMAGES, damage
from tests.cli_helpers import run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
QUIET = ("logging.tensorboard=false", "logging.progress_bar=false")
EVAL = ("eval.num_prompts=1", "eval.samples_per_prompt=1")
EXPECTED = {"flipped_bit": "fails verification: dcp/__0_0.distcp is damaged (checksum ",
            "truncated_shard": "fails verification: dcp/__0_0.distcp has ",
            "missing_complete": "is not a complete checkpoint (no COMPLETE marker"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny FLUX run of one step: its directory (one checkpoint, step_1)."""
    run = tmp_path_factory.mktemp("consumers") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1", *QUIET]) == 0
    finally:
        torch.set_num_threads(threads)
    return run


def _refused(main, capsys, how, *argv) -> str:
    code, errors, out = run_cli(main, capsys, *argv)
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert EXPECTED[how] in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("how", DAMAGES)
def test_resume_refuses_a_damaged_checkpoint(trained, tmp_path, capsys, how):
    bad = tmp_path / "step_1"
    damage(trained / "checkpoints" / "step_1", bad, how)
    run = tmp_path / "run"
    line = _refused(train_main, capsys, how, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=2",
                    f"checkpoint.resume={bad}", *QUIET)
    assert line.startswith(f"error: checkpoint.resume: {bad} "), line
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.parametrize("how", DAMAGES)
def test_model_path_refuses_a_damaged_checkpoint(trained, tmp_path, capsys, how):
    bad = tmp_path / "step_1"
    damage(trained / "checkpoints" / "step_1", bad, how)
    run = tmp_path / "run"
    line = _refused(train_main, capsys, how, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1",
                    f"model.path={bad}", *QUIET)
    assert line.startswith(f"error: model.path: {bad} "), line
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.parametrize("how", DAMAGES)
def test_leangrpo_eval_refuses_a_damaged_checkpoint(trained, tmp_path, capsys, how):
    bad = tmp_path / "step_1"
    damage(trained / "checkpoints" / "step_1", bad, how)
    out = tmp_path / "eval.json"
    line = _refused(eval_main, capsys, how, "--config", str(trained / "config.yaml"), "--checkpoint", str(bad),
                    "--out", str(out), *EVAL)
    assert line.startswith(f"error: --checkpoint: {bad} "), line
    assert not out.exists()


@pytest.mark.parametrize("how", DAMAGES)
def test_leangrpo_convert_refuses_a_damaged_checkpoint(trained, tmp_path, capsys, how):
    bad = tmp_path / "step_1"
    damage(trained / "checkpoints" / "step_1", bad, how)
    dst = tmp_path / "diffusers"
    line = _refused(convert_main, capsys, how, "mcore-to-diffusers", "--src", str(bad), "--dst", str(dst))
    assert line.startswith(f"error: --src: {bad} "), line
    assert not dst.exists() or not os.listdir(dst)
