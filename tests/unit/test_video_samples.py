"""Video sample grids: an H.264 mp4 that decodes back to the input frames, laid out as the PNG grid."""

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.output import samples
from leangrpo_mcore.engine.output.video import save_video_grid
from leangrpo_mcore.errors import UserError
from tests.unit.test_wandb_log import offline as offline_wandb  # noqa: F401 -- the fixture

iio = pytest.importorskip("imageio.v3", reason="the 'video' extra is not installed")
pytest.importorskip("imageio_ffmpeg", reason="the 'video' extra is not installed")

TINY_WAN = str(Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny" / "wan.yaml")


def _smooth_videos(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """Smooth ramps whose hue and offset change with the sample and the frame (H.264 keeps them well)."""
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    videos = torch.zeros(batch, 3, frames, height, width)
    for b in range(batch):
        for k in range(frames):
            videos[b, 0, k] = 0.1 + 0.6 * x + 0.05 * k
            videos[b, 1, k] = 0.15 + 0.5 * y + 0.1 * b
            videos[b, 2, k] = 0.1 + 0.18 * k
    return videos


def _tiles(frame: np.ndarray, count: int, cols: int, size: int) -> np.ndarray:
    """The (count, size, size, 3) samples of a decoded grid frame, undoing the layout independently: each sample
    is upscaled by ceil(128 / size) into a tile, tiles sit 4 pixels apart (and 3 caption lines of 12 pixels plus
    4 apart in height) from a 2-pixel margin, and each upscaled block is averaged back to one sample pixel."""
    scale = -(-128 // size)
    cell = size * scale
    out = []
    for i in range(count):
        x = (i % cols) * (cell + 4) + 2
        y = (i // cols) * (cell + 3 * 12 + 4 + 4) + 2
        tile = frame[y:y + cell, x:x + cell].astype(np.float64)
        out.append(tile.reshape(size, scale, size, scale, 3).mean(axis=(1, 3)))
    return np.stack(out)


def test_mp4_grid_decodes_to_the_input_frames(tmp_path):
    videos = _smooth_videos(2, 5, 32, 32)  # (2, 3, 5, 32, 32)
    path = str(tmp_path / "samples" / "step_1.mp4")
    frames = save_video_grid(path, videos, ["a ramp", "a greener ramp"], [0.5, -1.0], fps=8, columns=4)
    assert os.listdir(tmp_path / "samples") == ["step_1.mp4"]  # the temporary file was renamed
    decoded = iio.imread(path)
    # 2 samples side by side: 128-pixel tiles (32 px upscaled 4x) with 4-pixel gaps and a 40-pixel caption band.
    assert decoded.shape == frames.shape == (5, 128 + 40 + 4, 2 * (128 + 4), 3)
    expected = videos.permute(0, 2, 3, 4, 1).double().numpy()  # (B, F, H, W, 3) in [0, 1]
    for k in range(5):
        got = _tiles(decoded[k], 2, 2, 32) / 255.0
        error = np.abs(got - expected[:, k]).mean()
        assert error < 8 / 255, (k, error)
        # Each frame is closer to its own input frame than to its neighbours: the frames are in order.
        for other in {max(k - 1, 0), min(k + 1, 4)} - {k}:
            assert error < np.abs(got - expected[:, other]).mean() / 2
    # The caption band under the first tile holds text (dark pixels) in every frame.
    band = decoded[:, 2 + 128:2 + 128 + 36, 2:2 + 128].mean(axis=-1)
    assert (band.min(axis=(1, 2)) < 100).all()


def test_grid_frames_match_the_png_grid_and_odd_sizes_are_padded(tmp_path):
    videos = _smooth_videos(1, 3, 43, 43)  # 43 px upscaled 3x: an odd 133 x 177 grid
    frames = save_video_grid(str(tmp_path / "odd.mp4"), videos, ["odd"], [2.0])
    png = np.asarray(samples.make_grid(videos, ["odd"], [2.0]))
    assert png.shape == (43 * 3 + 40 + 4, 43 * 3 + 4, 3)
    assert frames.shape == (3, png.shape[0] + 1, png.shape[1] + 1, 3)
    assert np.array_equal(frames[0, :-1, :-1], png)  # frame 0 is the PNG grid of first frames
    assert (frames[:, -1] == 255).all() and (frames[:, :, -1] == 255).all()
    assert iio.imread(str(tmp_path / "odd.mp4")).shape == frames.shape


def test_missing_video_extra_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(UserError) as info:
        save_video_grid(str(tmp_path / "v.mp4"), torch.rand(1, 3, 1, 8, 8), ["a"], [0.0])
    assert str(info.value) == "writing video samples needs the 'video' extra: pip install 'leangrpo_mcore[video]'"
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full (every write: ENOSPC)")
def test_a_full_disk_is_named_and_leaves_no_file(tmp_path):
    """ffmpeg writing into a full device: the error line says "No space left on device" (the writer itself only
    sees ffmpeg's stdin close: "Broken pipe"), and neither the video nor its temporary file is left."""
    path = tmp_path / "full.mp4"
    tmp = f"{path}.tmp-{os.getpid()}.mp4"
    os.symlink("/dev/full", tmp)  # the writer's temporary file, on a device where every write fails with ENOSPC
    with pytest.raises(UserError) as info:
        save_video_grid(str(path), _smooth_videos(2, 9, 64, 64), ["a", "b"], [0.0, 1.0])
    assert str(info.value) == f"cannot write {path}: No space left on device"
    assert not os.path.lexists(tmp) and not path.exists()


def test_ffmpeg_failures_read_from_its_exit_code_or_its_last_line():
    from leangrpo_mcore.engine.output.video import ffmpeg_failure

    assert ffmpeg_failure(228, b"") == "No space left on device"  # AVERROR(ENOSPC) & 255
    assert ffmpeg_failure(243, b"") == "Permission denied"  # AVERROR(EACCES)
    assert ffmpeg_failure(1, b"[out#0] first\n[vf#0] Conversion failed!\n") == "[vf#0] Conversion failed!"
    assert ffmpeg_failure(1, b"") == "ffmpeg exited with code 1"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb (the 'wandb' extra) is not installed")
def test_tiny_wan_run_writes_an_mp4_next_to_the_png_and_its_evaluation_one(offline_wandb, tmp_path):
    from tests.unit.test_wandb_log import _history, _run_files

    run = tmp_path / "run"
    code = train_main(["--config", TINY_WAN, f"train.output_dir={run}", "train.max_steps=1", "sampler.frames=5",
                       "logging.tensorboard=false", "logging.video_fps=6", "eval.every=1", "eval.num_prompts=3",
                       "logging.wandb={project: tests, mode: offline}"])
    assert code == 0
    assert sorted(os.listdir(run / "samples")) == ["eval_step_1.mp4", "eval_step_1.png", "step_1.mp4", "step_1.png"]
    # the evaluation's 3 prompts x 1 sample, 5 frames each
    assert iio.imread(str(run / "samples" / "eval_step_1.mp4")).shape == (5, 128 + 40 + 4, 3 * (128 + 4), 3)
    png = np.asarray(Image.open(run / "samples" / "step_1.png").convert("RGB")).astype(np.float64)
    video = iio.imread(str(run / "samples" / "step_1.mp4"))
    # group_size 2 x prompts_per_step 2 = 4 generations of 32 x 32 pixels x 5 frames in one row.
    assert video.shape == (5, 128 + 40 + 4, 4 * (128 + 4), 3) and png.shape == video.shape[1:]
    assert iio.immeta(str(run / "samples" / "step_1.mp4"))["fps"] == 6
    # Frame 0 of the mp4 (the decoded video) shows what the PNG (the decoded first frames) shows.
    first, tiles = _tiles(video[0], 4, 4, 32), _tiles(png.astype(np.uint8), 4, 4, 32)
    assert np.abs(first - tiles).mean() < 8
    (path,) = _run_files(offline_wandb, 1)
    _, rows = _history(path)
    (logged,) = [row for row in rows if "samples_video/_type" in row]
    assert any("eval/samples_video/_type" in row for row in rows)
    assert logged["samples_video/_type"] == "video-file" and logged["_step"] == 1
    assert logged["samples_video/path"].endswith(".mp4")


def test_run_dir_names_train_and_eval_samples(tmp_path):
    from leangrpo_mcore.engine.output.run_dir import RunDir

    run = RunDir(str(tmp_path))
    assert run.sample_path(3) == os.path.join(str(tmp_path), "samples", "step_3.png")
    assert run.video_path(3) == os.path.join(str(tmp_path), "samples", "step_3.mp4")
    assert run.sample_path(40, prefix="eval_step") == os.path.join(str(tmp_path), "samples", "eval_step_40.png")
    assert run.video_path(40, prefix="eval_step") == os.path.join(str(tmp_path), "samples", "eval_step_40.mp4")
    with pytest.raises(ValueError, match="plain name"):
        run.video_path(1, prefix="../step")


def test_video_run_without_the_extra_stops_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as if the extra were not installed
    code = train_main(["--config", TINY_WAN, f"train.output_dir={tmp_path / 'run'}", "sampler.frames=5"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: writing video samples needs the 'video' extra: pip install 'leangrpo_mcore[video]'"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
