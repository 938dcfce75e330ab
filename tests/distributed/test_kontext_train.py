"""A tiny FLUX.1-Kontext edit run with a broken or a missing conditioning image, at world size 2: one error line
naming the file and its row on every rank, exit code 2 (the walkthrough's working run, with its [source | result]
grids and evaluation, is run as written by ``tests/unit/test_documented_commands.py``, ``tests/kontext_checks.py``)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_ranks, train_capturing
from tests.once import once_per_process

pytestmark = pytest.mark.distributed
pytest.importorskip("nvidia.dali", reason="DALI (nvidia-dali-cuda120, in the 'dali' and 'test' extras) is not installed")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "yaml_configs" / "flux_kontext" / "tiny_edit.yaml")




def _runs(rank: int, world_size: int, root: str) -> list:
    torch.set_num_threads(1)
    clip = [f"reward.options.reward_options.{name}.path={root}/demo/clip" for name in ("clip_consistency", "clip_score")]
    return [train_capturing(["--config", CONFIG, *clip, f"data.prompts={root}/{name}",
                             f"train.output_dir={root}/out/{name}"]) for name in ("broken", "missing")]


@pytest.fixture(scope="module")
@once_per_process
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kontext")
    done = subprocess.run([sys.executable, "tools/make_edit_demo.py", str(root / "demo")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    broken, missing = root / "broken", root / "missing"
    for folder in (broken, missing):
        shutil.copytree(root / "demo" / "data", folder)
    names = [json.loads(line)["image"] for line in (broken / "train_metadata.jsonl").read_text().splitlines()]
    for name in names[1:]:  # every training image of this copy but the first is cut short: step 1 reads one of them
        data = (broken / name).read_bytes()
        (broken / name).write_bytes(data[:len(data) // 4])
    (missing / names[3]).unlink()
    return root, run_ranks(_runs, 2, str(root), timeout=400)


def test_a_broken_or_missing_image_is_one_line_naming_file_and_row(runs):
    root, results = runs
    for rank, ((broken, broken_lines, broken_tb), (missing, missing_lines, missing_tb)) in enumerate(results):
        assert (broken, missing, broken_tb, missing_tb) == (2, 2, False, False)
        if rank:  # the job's line is printed once, by rank 0 in this harness
            assert broken_lines == missing_lines == []
            continue
        assert len(broken_lines) == 1 and "conditioning image" in broken_lines[0], broken_lines
        assert "cannot be decoded" in broken_lines[0] and "row " in broken_lines[0] and str(root) in broken_lines[0]
        assert len(missing_lines) == 1 and "does not exist" in missing_lines[0], missing_lines
        assert "row 4 does not exist" in missing_lines[0] and "data.prompts" in missing_lines[0]
    assert not (root / "out" / "missing").exists()  # refused before the run directory was made
    assert not list((root / "out" / "broken").glob("checkpoints/step_*"))  # stopped in step 1, nothing saved
