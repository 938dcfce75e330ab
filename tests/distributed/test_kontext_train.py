"""A tiny FLUX.1-Kontext edit run end to end at world size 2, the walkthrough's two commands as written (the demo
tool's dataset and tiny CLIP, then torchrun on the tiny edit config): each source image read by DALI and encoded
into reference tokens, the weighted consistency + text reward, [source | result] sample grids, an evaluation on the
test split. Then on gloo ranks: background scoring gives the same run, and a broken or missing image is one error
line naming the file and row."""

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from leangrpo_mcore.engine.throughput import TIMED_SCALARS
from tests.ckpt_helpers import model_tensors
from tests.distributed.launcher import free_port, run_ranks

pytestmark = pytest.mark.distributed
pytest.importorskip("nvidia.dali", reason="DALI (nvidia-dali-cuda120, in the 'dali' and 'test' extras) is not installed")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "yaml_configs/flux_kontext/tiny_edit.yaml"
SIZE, SCALE = 32, 2  # the config's 32 px; a [source | result] tile is 66 px wide, drawn twice as large
# docs/walkthrough.md, "Editing with Kontext" (torchrun --standalone, on a free port here)
DEMO = ["tools/make_edit_demo.py", "runs/edit_demo"]
TRAIN = ["-m", "leangrpo_mcore.train", "--config", CONFIG]


def _main_capturing(argv: list) -> tuple:
    """(exit code, the 'error:' lines, whether a traceback was printed) of one in-process run."""
    from leangrpo_mcore.cli.train import main as train_main

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream):
        code = train_main(argv)
    text = stream.getvalue()
    return code, [line for line in text.splitlines() if line.startswith("error:")], "Traceback" in text


def _runs(rank: int, world_size: int, root: str) -> list:
    torch.set_num_threads(1)
    os.chdir(root)  # the config's relative paths: runs/edit_demo/...
    common = ["--config", str(ROOT / CONFIG)]
    return [_main_capturing([*common, f"data.prompts={root}/broken", f"train.output_dir={root}/out/broken"]),
            _main_capturing([*common, f"data.prompts={root}/missing", f"train.output_dir={root}/out/missing"]),
            _main_capturing([*common, f"train.output_dir={root}/out/async", "reward.async_scoring=true"])]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    for name in ("tools", "yaml_configs"):  # the repository's files, from a directory of its own
        (root / name).symlink_to(ROOT / name)
    done = subprocess.run([sys.executable, *DEMO], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    done = subprocess.run([*launch, *TRAIN], capture_output=True, text=True, timeout=500, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished 2 / 2 steps (reweight schedule, world size 2)" in done.stdout
    demo = root / "runs" / "edit_demo"
    broken, missing = root / "broken", root / "missing"
    for folder in (broken, missing):
        shutil.copytree(demo / "data", folder)
    names = [json.loads(line)["image"] for line in (broken / "train_metadata.jsonl").read_text().splitlines()]
    for name in names:  # every training image of this copy but the first is cut short: step 1 reads one of them
        if name != names[0]:
            data = (broken / name).read_bytes()
            (broken / name).write_bytes(data[:len(data) // 4])
    (missing / names[3]).unlink()
    results = run_ranks(_runs, 2, str(root), timeout=600)
    return root, demo, results


def test_tiny_edit_run_trains_with_side_by_side_samples_and_an_evaluation(runs):
    root, demo, _ = runs
    run = root / "runs" / "tiny_kontext_edit"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["reward_mean"]) and row["reward_std"] > 0 for row in rows)
    first, last = model_tensors(run / "checkpoints" / "step_1"), model_tensors(run / "checkpoints" / "step_2")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # it trained
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 1 and evals[0]["step"] == 2 and evals[0]["num_prompts"] == 2
    assert math.isfinite(evals[0]["rewards"]["weighted"]["mean"])
    # the grids' first tile: a source picture of the dataset as the reader makes it, a gap, then the sample
    from leangrpo_mcore.data.images import ImageReader

    paths = sorted((demo / "data" / "images").iterdir())
    sources = (ImageReader(SIZE, SIZE, threads=1).read(paths) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    for grid_name in ("step_2.png", "eval_step_2.png"):
        grid = np.asarray(Image.open(run / "samples" / grid_name).convert("RGB"))
        tile = grid[2:2 + SIZE * SCALE, 2:2 + (2 * SIZE + 2) * SCALE]
        left = torch.from_numpy(tile[::SCALE, ::SCALE][:, :SIZE].copy())
        assert any(torch.equal(left, source) for source in sources), grid_name
        assert (tile[:, SIZE * SCALE:(SIZE + 2) * SCALE] == 255).all()  # the white gap
        result = torch.from_numpy(tile[::SCALE, ::SCALE][:, SIZE + 1:].copy())
        assert not any(torch.equal(result, source) for source in sources)


def test_a_broken_or_missing_image_is_one_line_naming_file_and_row(runs):
    root, _, results = runs
    for rank, rank_results in enumerate(results):
        (broken, broken_lines, broken_tb), (missing, missing_lines, missing_tb) = rank_results[:2]
        assert (broken, missing, broken_tb, missing_tb) == (2, 2, False, False)
        if rank:  # the job's line is printed once, by rank 0 in this harness
            assert broken_lines == missing_lines == []
            continue
        assert len(broken_lines) == 1 and "conditioning image" in broken_lines[0], broken_lines
        assert "cannot be decoded" in broken_lines[0] and "row " in broken_lines[0] and str(root) in broken_lines[0]
        assert len(missing_lines) == 1 and "does not exist" in missing_lines[0], missing_lines
        assert "row 4 does not exist" in missing_lines[0] and "data.prompts" in missing_lines[0]
    assert not (root / "out" / "missing" / "metrics.jsonl").exists()


def test_background_scoring_gives_the_rewards_the_same_sources(runs):
    """reward.async_scoring hands each sample's source to the reward on the decoding thread: the same run."""
    root, _, results = runs
    assert all(rank_results[2] == (0, [], False) for rank_results in results)
    timing = ("time_", "max_rss", *TIMED_SCALARS)

    def rows(name):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(timing)}
                for line in (root / name / "metrics.jsonl").read_text().splitlines()]

    assert rows("out/async") == rows("runs/tiny_kontext_edit")
    assert (root / "out" / "async" / "samples" / "step_2.png").read_bytes() == \
        (root / "runs" / "tiny_kontext_edit" / "samples" / "step_2.png").read_bytes()
