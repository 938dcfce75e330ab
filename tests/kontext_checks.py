"""What the walkthrough's tiny Kontext edit run (docs/walkthrough.md, "Editing with Kontext") must have written:
its training rows and checkpoints, an evaluation on the test split, and [source | result] sample grids whose
sources are the dataset's pictures as the DALI reader makes them (``tests/unit/test_documented_commands.py`` runs the
commands as written and calls :func:`check_edit_run`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

SIZE, SCALE = 32, 2  # the config's 32 px; a [source | result] tile is 66 px wide, drawn twice as large
RUN, DEMO = "runs/tiny_kontext_edit", "runs/edit_demo"


def check_edit_run(output: str, sandbox: Path) -> None:
    """The run at ``sandbox / RUN`` trained 2 steps at world size 2 with side-by-side grids and an evaluation."""
    from leangrpo_mcore.data.images import ImageReader
    from tests.ckpt_helpers import model_tensors

    assert "finished 2 / 2 steps (reweight schedule, world size 2)" in output, output[-2000:]
    run = sandbox / RUN
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["reward_mean"]) and row["reward_std"] > 0 for row in rows)
    first, last = model_tensors(run / "checkpoints" / "step_1"), model_tensors(run / "checkpoints" / "step_2")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # it trained
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 1 and evals[0]["step"] == 2 and evals[0]["num_prompts"] == 2
    assert math.isfinite(evals[0]["rewards"]["weighted"]["mean"])
    # each grid's first tile: a source picture of the dataset as the reader makes it, a white gap, the sample
    paths = sorted((sandbox / DEMO / "data" / "images").iterdir())
    sources = (ImageReader(SIZE, SIZE, threads=1).read(paths) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    for grid_name in ("step_2.png", "eval_step_2.png"):
        grid = np.asarray(Image.open(run / "samples" / grid_name).convert("RGB"))
        tile = grid[2:2 + SIZE * SCALE, 2:2 + (2 * SIZE + 2) * SCALE]
        left = torch.from_numpy(tile[::SCALE, ::SCALE][:, :SIZE].copy())
        assert any(torch.equal(left, source) for source in sources), grid_name
        assert (tile[:, SIZE * SCALE:(SIZE + 2) * SCALE] == 255).all()  # the white gap
        result = torch.from_numpy(tile[::SCALE, ::SCALE][:, SIZE + 1:].copy())
        assert not any(torch.equal(result, source) for source in sources)
