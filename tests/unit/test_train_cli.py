"""`leangrpo-train` robustness on one process: every bad input is one line on stderr and exit code 2.

The runs happen in this process (a one-rank group on an in-memory store), on the tiny FLUX config, so each case
costs well under a second once the imports are paid.
"""

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.engine.control.nonfinite import NonFiniteGuard
from leangrpo_mcore.rl.rewards import REWARDS, register_reward
from tests.ckpt_helpers import model_tensors
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")

if "nan_for_tests" not in REWARDS:
    @register_reward("nan_for_tests")
    def _nan_reward(images, prompts):
        """A broken reward: NaN on rank 1 of a distributed run, everywhere in a lone process."""
        out = images.mean(dim=(1, 2, 3))
        dist = torch.distributed
        if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_rank() == 1:
            out[:] = float("nan")
        return out


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _run(capsys, *argv):
    return run_cli(main, capsys, *argv)


def _assert_one_line_error(capsys, pattern, *argv):
    code, errors, err = _run(capsys, *argv)
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert pattern in errors[0], errors[0]
    return errors[0]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_config_errors(capsys, tmp_path):
    out = f"train.output_dir={tmp_path / 'run'}"
    _assert_one_line_error(capsys, "unknown key 'train.max_stepz' (did you mean 'train.max_steps'?)",
                           "--config", TINY_FLUX, out, "train.max_stepz=3")
    _assert_one_line_error(capsys, "'train.max_steps' must be int", "--config", TINY_FLUX, out, "train.max_steps=abc")
    _assert_one_line_error(capsys, "config file not found", "--config", str(tmp_path / "missing.yaml"))
    assert not (tmp_path / "run").exists()


def test_missing_config_non_finite_floats_and_missing_extras(capsys, tmp_path, monkeypatch):
    out = f"train.output_dir={tmp_path / 'run'}"
    _assert_one_line_error(capsys, "a config is required: leangrpo-train --config FILE", out)
    _assert_one_line_error(capsys, "command line: 'optim.lr' must be a finite number, got inf",
                           "--config", TINY_FLUX, out, "optim.lr=.inf")
    _assert_one_line_error(capsys, "command line: 'grpo.clip_range' must be a finite number, got nan",
                           "--config", TINY_FLUX, out, "grpo.clip_range=nan")
    monkeypatch.setitem(sys.modules, "rapidocr", None)  # as if the 'ocr' extra were not installed
    _assert_one_line_error(capsys, "reward.name=ocr needs the 'ocr' extra: pip install 'leangrpo_mcore[ocr]'",
                           "--config", TINY_FLUX, out, "reward.name=ocr")
    assert not (tmp_path / "run").exists()


def test_build_errors_write_nothing(capsys, tmp_path):
    out = f"train.output_dir={tmp_path / 'run'}"
    _assert_one_line_error(capsys, "missing.txt", "--config", TINY_FLUX, out, f"data.prompts={tmp_path / 'missing.txt'}")
    _assert_one_line_error(capsys, "tp=2 does not divide the world size 1", "--config", TINY_FLUX, out, "parallel.tp=2")
    _assert_one_line_error(capsys, "nowhere", "--config", TINY_FLUX, out, f"model.path={tmp_path / 'nowhere'}")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_reward_failures_stop_before_anything_is_saved(capsys, tmp_path):
    run = tmp_path / "run"
    _assert_one_line_error(capsys, "reward 'nan_for_tests' returned 1 non-finite values", "--config", TINY_FLUX,
                           f"train.output_dir={run}", "reward.name=nan_for_tests")
    assert os.listdir(run / "checkpoints") == [] and (run / "metrics.jsonl").read_text() == ""
    url = f"http://127.0.0.1:{_closed_port()}/score"
    _assert_one_line_error(capsys, f"reward server {url} unreachable after 1 attempts", "--config", TINY_FLUX,
                           f"train.output_dir={tmp_path / 'remote'}", "reward.name=remote", f"reward.url={url}",
                           "reward.retries=0", "reward.timeout_s=2")


def test_clobber_and_incompatible_resume(capsys, tmp_path):
    run = tmp_path / "run"
    out = f"train.output_dir={run}"
    code, errors, err = _run(capsys, "--config", TINY_FLUX, out, "train.max_steps=1")
    assert code == 0 and not errors, err
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    _assert_one_line_error(capsys, "already holds checkpoints (step_1); set checkpoint.resume=auto",
                           "--config", TINY_FLUX, out, "train.max_steps=2")
    _assert_one_line_error(capsys, "is incompatible with this config: its lora is None",
                           "--config", TINY_FLUX, out, "train.max_steps=2", "checkpoint.resume=auto",
                           "model.lora.rank=2")
    _assert_one_line_error(capsys, "is incompatible with this config: its model_config", "--config", TINY_FLUX, out,
                           "train.max_steps=2", "checkpoint.resume=auto", "model.arch={joint_attention_dim: 40}")
    _assert_one_line_error(capsys, "holds a flux policy, but model.family is wan", "--config", TINY_FLUX,
                           f"train.output_dir={tmp_path / 'other'}", f"model.path={run / 'checkpoints' / 'step_1'}",
                           "model.family=wan")
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]


def test_repeated_nonfinite_updates_stop_the_run(capsys, tmp_path):
    run = tmp_path / "run"
    line = _assert_one_line_error(capsys, "stopping at step 3: 2 consecutive updates had a non-finite", "--config",
                                  TINY_FLUX, f"train.output_dir={run}", "train.max_steps=6",
                                  "optim.lr=1e3", "optim.max_grad_norm=0", "train.max_nonfinite_skips=2")
    assert "train.max_nonfinite_skips=2" in line
    rows = [json.loads(text) for text in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"]) for r in rows] == [(1, 0), (2, 1), (3, 1)]
    # The step-2 checkpoint holds the weights after step 1: the skipped update never reached them.
    weights = model_tensors(run / "checkpoints" / "step_2")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert os.listdir(run / "checkpoints") == ["step_2"]


def test_nonfinite_guard_leaves_weights_and_state_untouched():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    guard = NonFiniteGuard(optimizer)
    layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in layer.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[layer.weight].items()}
    layer.weight.grad = torch.full_like(layer.weight, float("inf"))
    layer.bias.grad = torch.ones_like(layer.bias)
    optimizer.step()
    assert guard.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert all(torch.equal(state[k], optimizer.state[layer.weight][k]) for k in state)
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    assert guard.skipped == 1 and not torch.equal(before[0], layer.weight)


def test_demo_config_runs_unchanged_at_any_world_size(capsys, tmp_path):
    from leangrpo_mcore.config import load_config

    demo = str(ROOT / "yaml_configs" / "demo" / "tiny_flux_cpu.yaml")
    config = load_config(demo)
    assert (config.parallel.dp_shard, config.parallel.dp_replicate) == ("auto", "auto")
    assert (config.schedule.name, config.reward.name, config.model.text_encoder, config.model.vae) == (
        "reweight", "jpeg_compressibility", "hashed", "tiny")
    code, errors, output = _run(capsys, "--config", demo, f"train.output_dir={tmp_path / 'demo'}",
                                "train.max_steps=2", "logging.progress_bar=false")
    assert code == 0 and not errors, output
    assert "finished 2 / 2 steps (reweight schedule, world size 1)" in output and "reward: first" in output
    rows = [json.loads(text) for text in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_mean"] < 0 for r in rows)
    assert (tmp_path / "demo" / "samples" / "step_2.png").is_file()


def test_auto_schedule_runs_the_planner_and_records_its_choice(capsys, tmp_path):
    run = tmp_path / "run"
    code, errors, output = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "schedule.name=auto",
                                "train.max_steps=1")
    assert code == 0 and not errors, output
    assert "auto layout: schedule.name=" in output
    from leangrpo_mcore.config import load_config

    recorded = load_config(str(run / "config.yaml"))
    chosen = recorded.schedule.name
    assert chosen in ("native", "retain", "reweight")
    # the auto layout keys are recorded resolved (one process: nothing to shard, nothing to gather)
    p = recorded.parallel
    assert (p.dp_shard, p.dp_replicate, p.reshard_after_forward) == (1, 1, True)
    assert f"finished 1 / 1 steps ({chosen} schedule, world size 1)" in output


def test_launch_scripts_parse_and_demand_their_environment(tmp_path):
    import subprocess

    scripts = [ROOT / "examples" / name for name in ("train_single_node.sh", "train_multi_node.sh",
                                                    "train_slurm.sbatch")]
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    done = subprocess.run(["bash", str(scripts[1]), TINY_FLUX], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "error: NNODES is not set" in done.stderr
    done = subprocess.run(["bash", str(scripts[0])], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "usage:" in done.stderr
    text = "".join(script.read_text() for script in scripts)
    assert "MASTER_ADDR" in text and "127.0.0.1" not in text and "localhost" not in text


def test_resume_failure_paths_from_the_command_line(capsys, tmp_path):
    run = tmp_path / "run"
    out = f"train.output_dir={run}"
    code, errors, err = _run(capsys, "--config", TINY_FLUX, out, "train.max_steps=2", "checkpoint.save_every=1")
    assert code == 0 and not errors, err
    # A crashed save and a torn atomic write are removed before anything new is written.
    (run / "checkpoints" / "step_3.tmp-crashed").mkdir()
    (run / "config.yaml.tmp-999").write_text("half")
    # The newest checkpoint is damaged: auto resumes from the previous one with a warning ...
    distcp = run / "checkpoints" / "step_2" / "dcp" / "__0_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:100])
    code, errors, err = _run(capsys, "--config", TINY_FLUX, out, "train.max_steps=2", "checkpoint.save_every=1",
                             "checkpoint.resume=auto", "checkpoint.keep_last=1")
    assert code == 0 and not errors, err
    assert "is damaged (dcp/__0_0.distcp has 100 bytes" in err and "resumed from" in err
    assert not (run / "checkpoints" / "step_3.tmp-crashed").exists() and not (run / "config.yaml.tmp-999").exists()
    names = sorted(os.listdir(run / "checkpoints"))
    assert names[0] == "step_2" and names[1].startswith("step_2.damaged-") and len(names) == 2
    # ... and an explicit path that fails verification is one line, exit 2.
    damaged = run / "checkpoints" / names[1]
    rng = run / "checkpoints" / "step_2" / "rng" / "rank_0.pt"
    rng.write_bytes(b"")
    _assert_one_line_error(capsys, "fails verification: rng/rank_0.pt has 0 bytes", "--config", TINY_FLUX, out,
                           f"checkpoint.resume={run / 'checkpoints' / 'step_2'}")
    assert damaged.is_dir()


def test_fresh_run_refuses_earlier_metrics_unless_overwrite(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    _assert_one_line_error(capsys, "already holds the metrics of an earlier run (metrics.jsonl)", "--config",
                           TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "reward_mean": 0.5}\n'
    code, errors, err = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=1",
                             "train.overwrite=true")
    assert code == 0 and not errors, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward_mean"] != 0.5
