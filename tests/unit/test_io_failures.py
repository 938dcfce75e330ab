"""A full disk on the run directory's files during training: one `error:` line naming the file, exit code 2, no
temporary file left, the step's checkpoint written when one is due; background checkpoint writes published at
once and their failures reported at the next step; damaged metrics lines survive a resume.

The runs happen in this process on the tiny FLUX config (as in test_train_cli.py).
"""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.engine.checkpoint import manifest as ckpt_manifest
from leangrpo_mcore.engine.checkpoint import save as ck
from leangrpo_mcore.engine.output import metrics
from leangrpo_mcore.errors import UserError
from tests.cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
ENOSPC = "No space left on device"


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    """Every test here single-threaded (the shared fixture)."""
    yield


def _run(capsys, *argv):
    return run_cli(main, capsys, *argv)


def _steps(run: Path) -> list:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _temporaries(run: Path) -> list[str]:
    return [str(p) for p in run.rglob("*") if ".tmp-" in p.name]


class _FullAfter:
    """metrics.jsonl opened by the logger: rows are written until ``rows`` are in, then half a row and ENOSPC."""

    def __init__(self, fh, rows: int) -> None:
        self._fh, self._left = fh, rows

    def write(self, text: str) -> int:
        if self._left == 0:
            self._fh.write(text[:len(text) // 2])
            self._fh.flush()
            raise OSError(errno.ENOSPC, ENOSPC)
        self._left -= 1
        return self._fh.write(text)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def test_full_disk_on_metrics_is_one_line_after_the_steps_checkpoint(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(metrics, "open", lambda path, *a, **k: _FullAfter(open(path, *a, **k), rows=1),
                        raising=False)
    code, errors, out = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=4",
                             "checkpoint.save_every=2")
    assert code == 2 and "Traceback" not in out, out
    assert errors == [f"error: cannot write {run / 'metrics.jsonl'}: {ENOSPC}; the checkpoint of step 2 was saved"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2"]
    assert ckpt_manifest.verify(str(run / "checkpoints" / "step_2")) is None
    assert _temporaries(run) == []
    monkeypatch.undo()
    # The resumed run drops the torn half row and continues after the checkpoint.
    code, errors, out = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=4",
                             "checkpoint.save_every=2", "checkpoint.resume=auto")
    assert code == 0 and not errors, out
    assert _steps(run) == [1, 3, 4]


def test_full_disk_on_a_sample_png_is_one_line_and_leaves_no_temporary(capsys, tmp_path, monkeypatch):
    from PIL import Image

    run = tmp_path / "run"
    real_save = Image.Image.save

    def full_save(self, fp, *args, **kwargs):
        if not isinstance(fp, str):  # the JPEG reward encodes into memory
            return real_save(self, fp, *args, **kwargs)
        with open(fp, "wb") as fh:
            fh.write(b"\x89PNG half")  # what a disk that fills up mid-file leaves
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(Image.Image, "save", full_save)
    code, errors, out = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=4",
                             "checkpoint.save_every=2", "logging.sample_every=2")
    assert code == 2 and "Traceback" not in out, out
    png = run / "samples" / "step_2.png"
    assert errors == [f"error: cannot write {png}: {ENOSPC}; the checkpoint of step 2 was saved"]
    assert _temporaries(run) == [] and not png.exists()
    assert _steps(run) == [1, 2] and sorted(os.listdir(run / "checkpoints")) == ["step_2"]


def test_full_disk_between_checkpoints_stops_without_a_checkpoint(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(metrics, "open", lambda path, *a, **k: _FullAfter(open(path, *a, **k), rows=2),
                        raising=False)
    code, errors, out = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=4",
                             "checkpoint.save_every=2")
    assert code == 2 and errors == [f"error: cannot write {run / 'metrics.jsonl'}: {ENOSPC}"], out
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2"]


def test_failed_background_checkpoint_write_stops_at_the_next_step(capsys, tmp_path, monkeypatch):
    run = tmp_path / "run"

    def full_disk(state, folder, group):
        raise OSError(errno.ENOSPC, ENOSPC, os.path.join(folder, "__0_0.distcp"))

    monkeypatch.setattr(ck, "_dcp_save", full_disk)
    code, errors, out = _run(capsys, "--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=6",
                             "checkpoint.save_every=2", "checkpoint.async_save=true")
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    assert errors[0].startswith(f"error: cannot write checkpoint: {run / 'checkpoints' / 'step_2.tmp-'}")
    assert errors[0].endswith(f"/dcp/__0_0.distcp: {ENOSPC}")
    assert _steps(run) == [1, 2, 3]  # reported at the step after the save, not at the next save
    assert os.listdir(run / "checkpoints") == []


def test_background_checkpoints_are_published_and_resumed(capsys, tmp_path):
    run, straight = tmp_path / "run", tmp_path / "straight"
    common = ["--config", TINY_FLUX, "checkpoint.save_every=2", "checkpoint.async_save=true"]
    code, errors, out = _run(capsys, *common, f"train.output_dir={straight}", "train.max_steps=4")
    assert code == 0 and not errors, out
    code, errors, out = _run(capsys, *common, f"train.output_dir={run}", "train.max_steps=2")
    assert code == 0 and not errors, out
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2"]
    code, errors, out = _run(capsys, *common, f"train.output_dir={run}", "train.max_steps=4",
                             "checkpoint.resume=auto")
    assert code == 0 and not errors, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["reward_mean"]) for r in rows] == [
        (r["step"], r["loss"], r["reward_mean"]) for r in expected]


def test_a_damaged_metrics_line_survives_a_resume(capsys, tmp_path):
    run = tmp_path / "run"
    common = ["--config", TINY_FLUX, f"train.output_dir={run}", "checkpoint.save_every=2"]
    code, errors, out = _run(capsys, *common, "train.max_steps=4")
    assert code == 0 and not errors, out
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\x00\x00\n"  # the row of step 2, damaged in place
    (run / "metrics.jsonl").write_text("".join(lines))
    code, errors, out = _run(capsys, *common, "train.max_steps=6", "checkpoint.resume=auto")
    assert code == 0 and not errors, out
    assert f"{run / 'metrics.jsonl'}:2: not a JSON object; the line is kept as it is and skipped" in out
    after = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert after[:4] == lines and len(after) == 6
    assert [json.loads(line)["step"] for line in after[2:]] == [3, 4, 5, 6]


def test_tensorboard_failure_is_one_line_and_close_stays_quiet(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    logger = metrics.MetricsLogger(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), enabled=True)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    with pytest.raises(UserError, match=rf"^cannot write {tmp_path / 'tb'}: {ENOSPC}$"):
        logger.log(1, {"loss": 0.5})
    logger.log(2, {"loss": 0.25})  # nothing more is attempted after a failure
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [1]
