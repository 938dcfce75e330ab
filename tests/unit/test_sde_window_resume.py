"""MixGRPO-Flash's sampler through the training CLI: the progressive window moves as configured over the steps,
a run resumed from a checkpoint continues at the same position with the same numbers, and a setting that needs a
window is one error line naming its key. GRPO-Guard with two updates per rollout through the same CLI: every key
its metrics rows carry is documented."""

import json
import re
from pathlib import Path

import pytest

from leangrpo_mcore.cli.train import main
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
# 5 steps, a 1-step window sweeping starts 0, 1, 2 (one move per optimizer step), DPM-Solver++(2M) outside it and
# the steps after it compressed to 2
MIX_FLASH = ("sampler.num_steps=5", "sampler.sde_window_size=1", "sampler.sde_window_range=[0, 3]",
             "sampler.sde_window_schedule=progressive", "sampler.window_shift_every=1", "sampler.ode_solver=dpmpp_2m",
             "sampler.ode_steps_after_window=2", "grpo.timestep_selection=sde_window", "grpo.timestep_fraction=1.0",
             "checkpoint.save_every=2")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row for row in rows if "sde_window_start" in row}


@pytest.mark.slow
def test_progressive_window_moves_and_resumes_at_the_same_position(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["--config", TINY_FLUX, f"train.output_dir={whole}", "train.max_steps=4", *MIX_FLASH]) == 0
    assert main(["--config", TINY_FLUX, f"train.output_dir={resumed}", "train.max_steps=2", *MIX_FLASH]) == 0
    assert main(["--config", TINY_FLUX, f"train.output_dir={resumed}", "train.max_steps=4", "checkpoint.resume=auto",
                 *MIX_FLASH]) == 0
    rows, again = _rows(whole), _rows(resumed)
    # optimizer steps 0, 1, 2, 3 before steps 1..4: starts 0, 1, 2, then back to the first
    assert [rows[step]["sde_window_start"] for step in (1, 2, 3, 4)] == [0, 1, 2, 0]
    for step in (3, 4):
        assert again[step]["sde_window_start"] == rows[step]["sde_window_start"]
        for key in ("loss", "reward_mean", "grad_norm"):
            assert again[step][key] == rows[step][key], (step, key)


def test_a_solver_without_a_window_is_one_error_line(capsys, tmp_path):
    code, errors, output = run_cli(main, capsys, "--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}",
                                   "train.max_steps=1", "sampler.ode_solver=dpmpp_2m")
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    assert "sampler.ode_solver=dpmpp_2m" in errors[0] and "sampler.sde_window_size" in errors[0]


def _documented_keys() -> list[re.Pattern]:
    """The keys of docs/metrics.md's key table, ``<name>`` placeholders matching any word."""
    table = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    keys = [key for line in table.splitlines() if line.startswith("| `")
            for key in re.findall(r"`([^`]+)`", line.split(" | ")[0])]
    return [re.compile(r"\w+".join(re.escape(part) for part in re.split(r"<[^>]+>", key)) + "$") for key in keys]


@pytest.mark.slow
def test_grpo_guard_ratio_tail_and_two_updates_through_the_cli(tmp_path):
    """MixGRPO-Flash as published (Euler before the window, a 0.4 tail) with GRPO-Guard and K = 2: two training steps
    of two optimizer steps each; the rows carry the window's start and the per-step ratios, all documented."""
    run = tmp_path / "guard"
    args = [*MIX_FLASH[:-1], "sampler.ode_steps_after_window=0.4", "sampler.ode_solver_before_window=euler",
            "grpo.ratio_norm=true", "grpo.grad_reweight=flow_grpo", "grpo.updates_per_rollout=2",
            "grpo.prompts_per_step=2", "optim.lr_scheduler=linear", "optim.warmup_steps=1"]
    assert main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=2", *args]) == 0
    rows = _rows(run)
    assert sorted(rows) == [1, 2]
    # optimizer steps before step 2: 2 (K = 2), one shift each: the window at start 2
    assert [rows[1]["sde_window_start"], rows[2]["sde_window_start"]] == [0, 2]
    assert rows[1]["ratio_mean.step_0"] == pytest.approx(rows[1]["ratio_mean"])  # the window's one trained step
    assert "ratio_mean.step_2" in rows[2] and "clip_fraction.step_2" in rows[2]
    # the LR schedule spans the 4 optimizer steps (warm-up 1, then linear to 0 at the fourth): after 2 of them 2/3
    assert rows[2]["lr"] == pytest.approx(rows[1]["lr"] * 2 / 3)
    patterns = _documented_keys()
    undocumented = sorted(key for row in rows.values() for key in row if not any(p.match(key) for p in patterns))
    assert not undocumented, f"metrics keys missing from docs/metrics.md: {undocumented}"
