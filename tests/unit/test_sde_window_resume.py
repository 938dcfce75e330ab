"""MixGRPO-Flash's sampler through the training CLI: the progressive window moves as configured over the steps,
a run resumed from a checkpoint continues at the same position with the same numbers, and a setting that needs a
window is one error line naming its key."""

import json
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
