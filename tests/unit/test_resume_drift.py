"""Config drift on resume: every key compared with the checkpoint's config, one line per applied change, one
error line naming the keys that change what a step computes, the prompt data compared by fingerprint, and the
history of a run's configs kept under ``configs/``.

Each case resumes the one-step run of a module-scoped fixture (tiny FLUX, in this process).
"""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.config.drift import config_changes
from leangrpo_mcore.engine.build import resolve_plan
from leangrpo_mcore.engine.launch import DistContext
from tests.cli_helpers import run_cli
from tests.once import once_per_process

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
PROMPTS = ["a red cube", "a blue sphere", "a green cone", "a yellow torus"]


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _run(capsys, *argv):
    return run_cli(main, capsys, *argv)


@pytest.fixture(scope="module")
@once_per_process
def first_run(tmp_path_factory):
    """A finished one-step run on a four-prompt file: (run directory, prompt file)."""
    base = tmp_path_factory.mktemp("drift")
    prompts = base / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run = base / "run"
    torch.set_num_threads(1)
    assert main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1",
                 f"data.prompts={prompts}"]) == 0
    return run, prompts


@pytest.fixture
def run_copy(first_run, tmp_path):
    """A private copy of the first run (each case may resume and so change it)."""
    run, prompts = first_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, prompts


def _resume_args(run, prompts, *extra):
    return ("--config", TINY_FLUX, f"train.output_dir={run}", "checkpoint.resume=auto", "train.max_steps=2",
            f"data.prompts={prompts}", *extra)


@pytest.mark.parametrize("override, key", [
    ("grpo.group_size=4", "grpo.group_size (2 -> 4)"),
    ("sampler.num_steps=4", "sampler.num_steps (3 -> 4)"),
    ("schedule.name=native", "schedule.name ('reweight' -> 'native')"),
    ("grpo.prompts_per_step=4", "grpo.prompts_per_step (2 -> 4)"),
    ("reward.name=jpeg_incompressibility", "reward.name ('jpeg_compressibility' -> 'jpeg_incompressibility')"),
])
def test_a_change_of_what_a_step_computes_is_refused_naming_the_key(capsys, run_copy, override, key):
    run, prompts = run_copy
    metrics = (run / "metrics.jsonl").read_bytes()
    code, errors, output = _run(capsys, *_resume_args(run, prompts, override))
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert key in errors[0] and "train.allow_config_change=true" in errors[0], errors[0]
    assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / "checkpoints" / "step_2").exists()


def test_an_optimizer_change_is_applied_and_logged(capsys, run_copy):
    run, prompts = run_copy
    code, errors, output = _run(capsys, *_resume_args(run, prompts, "optim.lr=0.002"))
    assert code == 0 and not errors, output
    changed = [line.split("resume: ")[1] for line in output.splitlines() if "resume: " in line and " changed " in line]
    assert "optim.lr changed from 0.001 to 0.002; the new value applies" in changed
    # The copy moved the run, and this launch runs longer: logged too, and nothing else changed.
    assert sorted(line.split()[0] for line in changed) == ["optim.lr", "train.max_steps", "train.output_dir"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["lr"] == 1e-3 and rows[1]["lr"] == 2e-3


def test_replaced_prompts_are_refused_and_a_moved_file_is_not(capsys, run_copy, tmp_path):
    run, prompts = run_copy
    other = tmp_path / "other.txt"
    other.write_text("\n".join(p.replace("a ", "one ") for p in PROMPTS) + "\n")  # as many prompts, other texts
    code, errors, output = _run(capsys, *_resume_args(run, other))
    assert code == 2 and len(errors) == 1 and "data.prompts (content)" in errors[0], output
    moved = tmp_path / "moved.txt"
    moved.write_bytes(prompts.read_bytes())
    code, errors, output = _run(capsys, *_resume_args(run, moved))
    assert code == 0 and not errors, output
    assert f"resume: data.prompts changed from '{prompts}' to '{moved}'; the new value applies" in output


def test_allow_config_change_applies_logs_and_keeps_the_history(capsys, run_copy):
    run, prompts = run_copy
    code, errors, output = _run(capsys, *_resume_args(run, prompts, "grpo.group_size=4",
                                                      "train.allow_config_change=true"))
    assert code == 0 and not errors, output
    assert "resume: grpo.group_size changed from 2 to 4; applied (train.allow_config_change=true)" in output
    history = sorted(p.name for p in (run / "configs").iterdir())
    assert history == ["config_step_0.yaml", "config_step_1.yaml"]
    assert load_config(run / "configs" / "config_step_0.yaml").grpo.group_size == 2
    assert load_config(run / "configs" / "config_step_1.yaml").grpo.group_size == 4
    assert load_config(run / "config.yaml").grpo.group_size == 4


def test_every_key_is_compared_and_unlisted_keys_are_refused(first_run):
    run, prompts = first_run
    saved = yaml.safe_load((run / "checkpoints" / "step_1" / "config.yaml").read_text())
    config = load_config(TINY_FLUX, [f"data.prompts={prompts}", f"train.output_dir={run}", "train.max_steps=1",
                                     "model.arch={num_layers: 2}", "logging.sample_every=3", "train.seed=7",
                                     "reward.options={quality: 50}"])
    # as the trainer compares it: with the keys left auto resolved by the planner for this one-process run
    config = resolve_plan(config, DistContext(0, 1, 0, torch.device("cpu"), "gloo", False), logging.getLogger("t"))
    changes = {c.key: c.applied for c in config_changes(saved, config)}
    assert changes == {"model.arch": False, "logging.sample_every": True, "train.seed": False,
                       "reward.options": False}
