"""The README's demo trained on two ranks with a learned reward (PickScore on a tiny random CLIP) and evaluated every
step: ``eval.jsonl`` has a row per evaluation, and ``leangrpo-eval`` of the run's checkpoint on one rank gives the
rewards the two-rank run logged for it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from leangrpo_mcore.cli.eval import main as eval_main
from tests.distributed.launcher import free_port
from tests.reward_models import write_tiny_clip_dir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "yaml_configs" / "demo" / "tiny_flux_cpu.yaml")


def test_two_rank_pickscore_run_evaluates_every_step_as_one_rank_does(tmp_path):
    clip = tmp_path / "clip"
    clip.mkdir()
    write_tiny_clip_dir(clip)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "leangrpo_mcore.train",
           "--config", DEMO, f"train.output_dir={run}", "train.max_steps=2", "checkpoint.save_every=1",
           "logging.sample_every=0", "logging.progress_bar=false", "reward.name=pickscore",
           f"reward.options={{path: {clip}, batch_size: 3}}", "eval.every=1", "eval.before_train=true",
           "eval.num_prompts=3", "eval.samples_per_prompt=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # PickScore of a random CLIP: exp(logit_scale) * cos / 26 lies in (-100/26, 100/26), and it is not constant
    assert all(abs(m["reward_mean"]) < 100 / 26 and m["reward_std"] > 0 for m in metrics)
    out = tmp_path / "step1.json"
    torch.set_num_threads(1)
    assert eval_main(["--config", str(run / "config.yaml"), "--checkpoint", str(run / "checkpoints" / "step_1"),
                      "--out", str(out)]) == 0
    one_rank = json.loads(out.read_text())["rewards"]["pickscore"]
    two_ranks = rows[1]["rewards"]["pickscore"]
    np.testing.assert_allclose(one_rank["per_prompt"], two_ranks["per_prompt"], rtol=1e-5)
    for stat in ("mean", "min", "max"):
        assert one_rank[stat] == pytest.approx(two_ranks[stat], rel=1e-5)
    assert rows[0]["rewards"]["pickscore"]["mean"] != pytest.approx(rows[2]["rewards"]["pickscore"]["mean"], rel=1e-7)
