"""Progress output of rank 0: bars on a terminal, one plain line per step otherwise (no ``\\r`` frames)."""

import io
import re
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.engine.output.metrics import ProgressBar, step_line

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
ROW = {"reward_mean": -0.5, "reward_std": 0.25, "loss": 1e-3, "time_step_s": 1.5, "time_rollout_s": 0.75,
       "time_reward_s": 0.25, "lr": 1e-3}


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def test_step_line_has_the_step_fields():
    line = step_line(3, 10, ROW)
    assert line == ("step 3/10 reward_mean=-0.5 reward_std=0.25 loss=0.001 step_time=1.50s "
                    "(rollout=0.75s reward=0.25s)")


def test_not_a_terminal_writes_one_line_per_step_and_no_bar():
    stream = io.StringIO()
    bar = ProgressBar(4, 1, enabled=True, stream=stream)
    assert not bar.interactive and bar.rollout_hook is None
    bar.rollout(1, 6)  # a stray call is harmless
    bar.update(2, ROW)
    bar.update(3, ROW)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text and text.splitlines() == [step_line(2, 4, ROW), step_line(3, 4, ROW)]


def test_disabled_writes_nothing():
    stream = FakeTerminal()
    bar = ProgressBar(4, 0, enabled=False, stream=stream)
    assert bar.rollout_hook is None
    bar.update(1, ROW)
    bar.close()
    assert stream.getvalue() == ""


def test_terminal_shows_a_step_bar_and_a_rollout_bar():
    stream = FakeTerminal()
    bar = ProgressBar(4, 0, enabled=True, stream=stream)
    hook = bar.rollout_hook
    assert bar.interactive and hook is not None
    for step in (1, 2):
        for done in range(1, 7):
            hook(done, 6)
        bar.update(step, ROW)
    bar.close()
    frames = stream.getvalue()
    assert "\r" in frames and "step_time=" not in frames
    assert re.search(r"rollout: *100%.*6/6", frames) and "train:  50%" in frames and "2/4" in frames
    assert "reward=-0.5 std=0.25 loss=0.001" in frames


def _train(capsys, tmp_path, *overrides):
    code = main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
                 "logging.tensorboard=false", *overrides])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured


def test_run_without_a_terminal_logs_one_plain_line_per_step(capsys, tmp_path):
    captured = _train(capsys, tmp_path, "logging.progress_bar=true")
    output = captured.err + captured.out
    assert "\r" not in output
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], output
    for line in lines:
        assert re.fullmatch(r"step \d/2 reward_mean=\S+ reward_std=\S+ loss=\S+ step_time=[\d.]+s \(.*\)", line), line
        assert re.search(r"[( ]rollout=[\d.]+s", line) and re.search(r"[( ]reward=[\d.]+s", line), line


def test_run_on_a_terminal_moves_the_rollout_bar(capsys, tmp_path, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    _train(capsys, tmp_path, "logging.progress_bar=true")
    frames = terminal.getvalue()
    # 2 prompts x 2 generations, one per micro-batch, 3 denoising steps each: 12 rollout ticks per step.
    assert re.search(r"rollout: *100%.*12/12", frames), frames
    assert "train: 100%" in frames and not any(line.startswith("step ") for line in frames.splitlines())
    # Log lines go above the bars (tqdm.write), on lines of their own.
    assert re.search(r"\[leangrpo 0\] saved checkpoint \S+step_2\n", frames), frames
