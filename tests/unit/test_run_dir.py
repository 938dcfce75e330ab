"""The run directory: clobber refusal, metrics truncation on resume, metric rows, sample grids."""

import json
import math
import os

import pytest
import torch
from PIL import Image

from leangrpo_mcore.engine.output import metrics, run_dir, samples
from leangrpo_mcore.errors import UserError


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    rd = run_dir.RunDir(str(tmp_path / "run"))
    run_dir.check_fresh_run(rd)  # does not exist yet: fine
    os.makedirs(os.path.join(rd.checkpoints_dir, "step_3"))
    with open(rd.metrics_path, "w") as fh:
        fh.write('{"step": 1}\n')
    with pytest.raises(UserError, match=r"already holds checkpoints \(step_3\).*checkpoint.resume=auto"):
        run_dir.check_fresh_run(rd)
    assert open(rd.metrics_path).read() == '{"step": 1}\n'
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        run_dir.check_fresh_run(run_dir.RunDir(str(tmp_path / "file")))


def test_prepare_truncates_metrics_to_the_resumed_step(tmp_path):
    rd = run_dir.RunDir(str(tmp_path / "run"))
    os.makedirs(rd.root)
    with open(rd.metrics_path, "w") as fh:
        for step in range(1, 6):
            fh.write(json.dumps({"step": step, "loss": step * 0.5}) + "\n")
        fh.write('{"step": 6, "lo')  # a torn line from a kill mid-write
    run_dir.prepare(rd, "train: {}\n", resume_step=3)
    assert [row["step"] for row in run_dir.read_metrics(rd.metrics_path)] == [1, 2, 3]
    assert open(rd.config_path).read() == "train: {}\n"
    assert os.path.isdir(rd.samples_dir) and os.path.isdir(rd.checkpoints_dir)
    run_dir.prepare(rd, "train: {}\n", resume_step=None)
    assert run_dir.read_metrics(rd.metrics_path) == []


def test_reward_stats_and_metrics_logger(tmp_path):
    stats = metrics.reward_stats(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert stats["reward_mean"] == 3.0 and math.isclose(stats["reward_std"], math.sqrt(3.5))
    logger = metrics.MetricsLogger(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), enabled=True)
    logger.log(1, {"loss": 0.5, "reward_mean": float("nan")})
    logger.log(2, {"loss": 0.25, "reward_mean": 1.0})
    logger.close()
    got = run_dir.read_metrics(str(tmp_path / "m.jsonl"))
    assert got == [{"step": 1, "loss": 0.5, "reward_mean": "nan"}, {"step": 2, "loss": 0.25, "reward_mean": 1.0}]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    quiet = metrics.MetricsLogger(str(tmp_path / "q.jsonl"), None, enabled=False)
    quiet.log(1, {"loss": 1.0})
    assert not (tmp_path / "q.jsonl").exists()


def test_sample_grid_layout_and_first_frames(tmp_path):
    images = torch.zeros(3, 3, 16, 16)
    images[0, 0] = 1.0  # red
    images[1, 1] = 1.0  # green
    images[2] = float("nan")
    path = str(tmp_path / "samples" / "step_2.png")
    grid = samples.save_grid(path, images, ["a red square", "a green square", "nan"], [0.5, -1.25, 0.0],
                             columns=2)
    on_disk = Image.open(path)
    assert on_disk.size == grid.size == (2 * (128 + 4), 2 * (128 + 3 * 12 + 4 + 4))
    assert on_disk.getpixel((2 + 64, 2 + 64)) == (255, 0, 0)
    assert on_disk.getpixel((132 + 2 + 64, 2 + 64)) == (0, 255, 0)
    assert on_disk.getpixel((2 + 64, 172 + 2 + 64)) == (0, 0, 0)
    caption_band = on_disk.crop((2, 2 + 128, 2 + 128, 2 + 128 + 36)).convert("L")
    assert min(caption_band.tobytes()) < 100  # text was drawn under the image
    video = torch.rand(2, 3, 5, 8, 8)
    assert torch.equal(samples.first_frames(video), video[:, :, 0])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        samples.make_grid(torch.rand(2, 3, 8, 8), ["a"], [1.0])


def _jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_a_malformed_metrics_line_is_kept_and_the_rows_after_it_survive(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    head = _jsonl([{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])
    bad = '{"step": 3, "loss": 0.1\x00\x00garbage\n'  # a damaged row in the middle of the history
    tail = _jsonl([{"step": s, "loss": s / 8} for s in (4, 5, 6)])
    with open(path, "w") as fh:
        fh.write(head + bad + tail + '{"step": 7, "lo')  # and a torn last line
    warnings = []
    dropped = run_dir.truncate_metrics(path, 5, warnings.append)
    # Byte for byte what was there up to the row of step 5: the damaged line stays, nothing is rebuilt.
    assert open(path).read() == head + bad + _jsonl([{"step": 4, "loss": 0.5}, {"step": 5, "loss": 0.625}])
    assert dropped == 1
    assert warnings == [f"{path}:3: not a JSON object; the line is kept as it is and skipped"]
    assert [row["step"] for row in run_dir.read_metrics(path)] == [1, 2, 4, 5]
    # A cut before the damaged line drops it with the rows of the steps to be redone, silently.
    warnings.clear()
    assert run_dir.truncate_metrics(path, 1, warnings.append) == 3
    assert open(path).read() == _jsonl([{"step": 1, "loss": 0.5}]) and warnings == []


def test_a_last_row_without_its_newline_is_kept_and_terminated(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as fh:
        fh.write('{"step": 1}\n{"step": 2}')
    assert run_dir.truncate_metrics(path, 2) == 0
    assert open(path).read() == '{"step": 1}\n{"step": 2}\n'
    run_dir.append_jsonl(path, {"step": 3})
    assert [row["step"] for row in run_dir.read_metrics(path)] == [1, 2, 3]


def test_failed_atomic_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", src)

    monkeypatch.setattr(os, "replace", full)
    target = str(tmp_path / "config.yaml")
    with pytest.raises(UserError, match=rf"^cannot write {target}: No space left on device$"):
        run_dir.write_text_atomic(target, "x: 1\n")
    monkeypatch.setattr(os, "replace", real_replace)
    assert os.listdir(tmp_path) == []
