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
from tests.once import once_per_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
QUIET = ("logging.tensorboard=false", "logging.progress_bar=false")
EVAL = ("eval.num_prompts=1", "eval.samples_per_prompt=1")
EXPECTED = {"flipped_bit": "fails verification: dcp/__0_0.distcp is damaged (checksum ",
            "truncated_shard": "fails verification: dcp/__0_0.distcp has ",
            "missing_complete": "is not a complete checkpoint (no COMPLETE marker"}


@pytest.fixture(scope="module")
@once_per_process
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


def _run_with_damaged_checkpoint(trained: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the trained run directory whose only checkpoint is damaged ``how``."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("step_1"))
    damage(trained / "checkpoints" / "step_1", run / "checkpoints" / "step_1", how)
    return run


@pytest.mark.parametrize("how", ["flipped_bit", "missing_complete"])
def test_auto_stops_when_every_checkpoint_is_damaged_and_fresh_if_damaged_starts_afresh(trained, tmp_path, capsys,
                                                                                       how):
    run = _run_with_damaged_checkpoint(trained, tmp_path, how)
    metrics = (run / "metrics.jsonl").read_text()
    argv = ["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=2", *QUIET]
    for _ in range(2):  # a requeued launch finds the same: nothing was set aside
        code, errors, out = run_cli(train_main, capsys, *argv, "checkpoint.resume=auto")
        assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
        line = errors[0]
        assert line.startswith(f"error: checkpoint.resume=auto: no checkpoint in {run / 'checkpoints'} verifies "
                               "(step_1: "), line
        assert ("dcp/__0_0.distcp is damaged" if how == "flipped_bit" else "no COMPLETE marker") in line, line
        assert "checkpoint.resume=fresh_if_damaged" in line
        assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]
        assert (run / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing logged
    if how == "missing_complete":
        assert "step_1 has no COMPLETE marker" in out  # the warning names the directory
    code, errors, out = run_cli(train_main, capsys, *argv, "train.max_steps=1", "checkpoint.resume=fresh_if_damaged")
    assert code == 0 and not errors, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    names = sorted(os.listdir(run / "checkpoints"))  # set aside for inspection; the fresh run wrote its own step_1
    assert names[0] == "step_1" and names[1].startswith("step_1.damaged-") and len(names) == 2
    assert "starting afresh (checkpoint.resume=fresh_if_damaged)" in out


def test_verify_false_skips_the_check_on_purpose_and_read_errors_stay_one_line(trained, tmp_path, capsys):
    flipped = tmp_path / "flipped"
    damage(trained / "checkpoints" / "step_1", flipped, "flipped_bit")
    run = tmp_path / "run"
    code, errors, out = run_cli(train_main, capsys, "--config", TINY_FLUX, f"train.output_dir={run}",
                                "train.max_steps=1", f"model.path={flipped}", "checkpoint.verify=false", *QUIET)
    assert code == 0 and not errors, out
    assert (f"model.path: {flipped} is read without checking it against its COMPLETE marker "
            "(checkpoint.verify=false)") in out
    truncated = tmp_path / "truncated"
    rel = damage(trained / "checkpoints" / "step_1", truncated, "truncated_shard")
    code, errors, out = run_cli(eval_main, capsys, "--config", str(trained / "config.yaml"), "--checkpoint",
                                str(truncated), "checkpoint.verify=false", *EVAL)
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert errors[0].startswith(f"error: cannot read checkpoint {truncated / rel}: truncated (EOFError"), errors[0]


def test_evaluation_loads_the_weights_and_ema_only(trained, monkeypatch):
    """leangrpo-eval --checkpoint reads no optimizer state: nothing under optim/ is requested from the files and
    the optimizer holds no state, while the weights are the checkpoint's."""
    import torch.distributed.checkpoint as dcp

    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine import build, eval_run
    from tests.checkpoint_damage import stored_weight

    requested, built = [], {}
    real_load, real_parts = dcp.load, build.build_policy_parts

    def recording_load(state, *args, **kwargs):
        requested.extend(state)
        return real_load(state, *args, **kwargs)

    def keeping_parts(*args, **kwargs):
        built["parts"] = real_parts(*args, **kwargs)
        return built["parts"]

    monkeypatch.setattr(dcp, "load", recording_load)
    monkeypatch.setattr(build, "build_policy_parts", keeping_parts)
    config = load_config(str(trained / "config.yaml"), list(EVAL))
    result = eval_run.evaluate_model(config, str(trained / "checkpoints" / "step_1"))
    assert result.step == 1
    assert requested and any(k.startswith("model/") for k in requested)
    assert not [k for k in requested if k.startswith("optim/")]
    parts = built["parts"]
    assert len(parts.optimizer.state) == 0
    params = dict(parts.policy.named_parameters())
    assert params and all(torch.equal(p.detach(), stored_weight(trained / "checkpoints" / "step_1", n))
                          for n, p in params.items())
