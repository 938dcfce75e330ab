"""End-to-end training of the tiny FLUX and tiny Wan configs at world size 1 and 2.

World size 1 runs in this process; world size 2 runs once under ``torchrun`` (FLUX, the documented launch) and
once on the gloo launcher (Wan, which also checks that bad input stops every rank with exit code 2).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.throughput import TIMED_SCALARS
from leangrpo_mcore.rl.rewards import REWARDS, register_reward
from tests.ckpt_helpers import model_tensors, stored_tensors
from tests.distributed.launcher import free_port, run_ranks, train_capturing
from tests.once import once_per_process

VARYING = ("time_", "max_rss", *TIMED_SCALARS)
"""Prefixes of the metrics that differ between otherwise identical runs."""

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
# The tiny configs' reward is the JPEG size in kB of uint8 images: a rounding-level weight difference can move a
# pixel across a uint8 step and a sample's file by a byte or two, so rewards of runs that differ only in reduction
# order agree to a few 1e-3 kB, not to float rounding (the weights are compared to float rounding instead).
JPEG_BYTE = 2e-3
TINY = {name: str(ROOT / "yaml_configs" / "tiny" / f"{name}.yaml") for name in ("flux", "wan")}
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "train.ema_decay=0.5")
# TP=2 and TP=1 images differ by fp32 rounding; a JPEG reward turns a pixel that rounds to the next uint8 level
# into a different byte count, and so different advantages. Cross-TP comparisons use a reward that is smooth
# in the pixels instead.
SMOOTH = ("reward.name=mean_intensity_for_tests",)
# Background scoring (reward.async_scoring) against synchronous scoring: LoRA with a KL term, two steps.
BACKGROUND = ("model.lora.rank=4", "model.lora.alpha=8", "grpo.kl_beta=0.05", "train.max_steps=2")

if "nan_on_rank1" not in REWARDS:
    @register_reward("nan_on_rank1")
    def _nan_on_rank1(images, prompts):
        """A broken reward on rank 1 only: the other rank must stop too."""
        out = images.mean(dim=(1, 2, 3))
        if torch.distributed.get_rank() == 1:
            out[:] = float("nan")
        return out

if "mean_intensity_for_tests" not in REWARDS:
    @register_reward("mean_intensity_for_tests")
    def _mean_intensity(images, prompts):
        """Mean pixel intensity: continuous in the pixels, unlike a JPEG size."""
        return images.mean(dim=(1, 2, 3))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_here(config: str, run: Path, *overrides: str) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main(["--config", config, f"train.output_dir={run}", *overrides]) == 0
    finally:
        torch.set_num_threads(threads)
    return _rows(run)


@pytest.fixture(scope="module")
@once_per_process
def flux_world1(tmp_path_factory):
    run = tmp_path_factory.mktemp("flux1") / "run"
    return run, _train_here(TINY["flux"], run)


def _check_run_dir(run: Path, steps: int) -> None:
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("reward_mean", "reward_std", "loss", "time_step_s", "time_rollout_s", "time_backward_s",
                "clip_fraction", "ratio_mean", "max_rss_bytes"):
        assert all(key in r for r in rows), key
    assert all(r["reward_mean"] < 0 and r["reward_std"] > 0 and r["skipped"] == 0 for r in rows)
    assert all(abs(r["ratio_mean"] - 1.0) < 1e-5 for r in rows)  # on-policy: the ratio is one
    assert sorted(os.listdir(run / "checkpoints")) == ["step_2", f"step_{steps}"]
    assert os.listdir(run / "samples") == [f"step_{steps}.png"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run / "tensorboard"))
    assert "max_steps: 3" in (run / "config.yaml").read_text()


def test_flux_world1_trains_and_exports_to_diffusers(flux_world1, tmp_path):
    run, rows = flux_world1
    _check_run_dir(run, 3)
    first = model_tensors(run / "checkpoints" / "step_2")
    last = model_tensors(run / "checkpoints" / "step_3")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the weights moved
    assert convert_main(["mcore-to-diffusers", "--src", str(run / "checkpoints" / "step_3"),
                         "--dst", str(tmp_path / "export")]) == 0
    from diffusers import FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(str(tmp_path / "export"))
    assert sum(p.numel() for p in exported.parameters()) == sum(t.numel() for t in last.values())
    # The master weights leave in their own dtype, or in the one asked for.
    from safetensors import safe_open

    assert convert_main(["mcore-to-diffusers", "--src", str(run / "checkpoints" / "step_3"), "--dtype", "bfloat16",
                         "--dst", str(tmp_path / "bf16")]) == 0
    for folder, dtype in (("export", torch.float32), ("bf16", torch.bfloat16)):
        with safe_open(str(tmp_path / folder / "diffusion_pytorch_model.safetensors"), framework="pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {dtype}


@pytest.fixture(scope="module")
@once_per_process
def flux_world2(tmp_path_factory):
    run = tmp_path_factory.mktemp("flux2") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "leangrpo_mcore.train", "--config", TINY["flux"], f"train.output_dir={run}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stdout, done.stderr


def test_flux_world2_under_torchrun_matches_world1(flux_world1, flux_world2):
    _, reference = flux_world1
    run, stdout, _ = flux_world2
    assert "finished 3 / 3 steps (reweight schedule, world size 2)" in stdout
    assert stdout.count("finished") == 1  # the summary comes from rank 0 only
    _check_run_dir(run, 3)
    rows = _rows(run)
    # Same seeds, so the same trajectories: step 1 is identical, later steps agree to reduction-order rounding.
    assert all(rows[0][k] == reference[0][k] for k in ("reward_mean", "reward_std"))
    for mine, ref in zip(rows, reference):
        assert mine["reward_mean"] == pytest.approx(ref["reward_mean"], abs=JPEG_BYTE)
    _close_weights(run / "checkpoints" / "step_3", flux_world1[0] / "checkpoints" / "step_3", rtol=1e-4)


def _resume_here(src: Path, dst: Path, capsys, *overrides: str) -> tuple[list[dict], str]:
    """Copy a run directory, resume it from its step-2 checkpoint on this single process; (rows, its log)."""
    shutil.copytree(src, dst)
    capsys.readouterr()
    rows = _train_here(TINY["flux"], dst, f"checkpoint.resume={dst / 'checkpoints' / 'step_2'}", *overrides)
    return rows, capsys.readouterr().err


def _close_weights(a: Path, b: Path, rtol: float, atol: float = 1e-6) -> None:
    mine, ref = model_tensors(a), model_tensors(b)
    assert mine.keys() == ref.keys()
    for name in ref:
        assert torch.allclose(mine[name], ref[name], rtol=rtol, atol=atol), name


def test_torchrun_log_has_no_library_noise(flux_world2):
    """The first lines a user sees: no FSDP2 warning about a view output, no megatron-core fallback notice."""
    _, stdout, stderr = flux_world2
    log = stdout + stderr
    assert "[leangrpo 0] saved checkpoint" in log  # the log is the run's
    for noise in ("returned a view tensor", "Apex is not installed", "UserWarning"):
        assert noise not in log, noise


def test_fsdp_world2_checkpoint_resumes_at_world1(flux_world1, flux_world2, tmp_path, capsys):
    ref_run, reference = flux_world1
    rows, log = _resume_here(flux_world2[0], tmp_path / "run", capsys)
    assert "resharding checkpoint written at world size 2 (tp 1) to world size 1 (tp 1)" in log
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["reward_mean"] == pytest.approx(reference[2]["reward_mean"], abs=JPEG_BYTE)
    _close_weights(tmp_path / "run" / "checkpoints" / "step_3", ref_run / "checkpoints" / "step_3", rtol=1e-4)


def test_wan_world1(tmp_path):
    rows = _train_here(TINY["wan"], tmp_path / "run")
    _check_run_dir(tmp_path / "run", 3)
    assert rows[-1]["reward_mean"] != rows[0]["reward_mean"]




def _world2_runs(rank, world_size, root):
    torch.set_num_threads(1)
    runs = [["--config", TINY["wan"], f"train.output_dir={root}/wan2"],
            ["--config", TINY["wan"], f"train.output_dir={root}/resumed", "train.max_steps=2"],
            ["--config", TINY["wan"], f"train.output_dir={root}/resumed", "checkpoint.resume=auto"],
            ["--config", TINY["wan"], f"train.output_dir={root}/nan", "reward.name=nan_on_rank1"],
            ["--config", TINY["wan"], f"train.output_dir={root}/tp3", "parallel.tp=3"],
            ["--config", TINY["flux"], f"train.output_dir={root}/tp2", "parallel.tp=2", *LORA, *SMOOTH],
            *[["--config", TINY["flux"], f"train.output_dir={root}/{name}", *BACKGROUND, *extra]
              for name, extra in (("bg_sync", ()), ("bg_async", ("reward.async_scoring=true",)))],
            ["--config", TINY["flux"], f"train.output_dir={root}/bg_nan", "reward.name=nan_on_rank1",
             "reward.async_scoring=true"]]
    return [train_capturing(argv) for argv in runs]


@pytest.fixture(scope="module")
@once_per_process
def world2_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("world2")
    codes = run_ranks(_world2_runs, 2, str(root), timeout=300)
    return root, codes


def test_wan_world2_and_bad_input_stops_every_rank(world2_runs):
    root, results = world2_runs
    for rank, rank_results in enumerate(results):
        assert [code for code, _, _ in rank_results[:6]] == [0, 0, 0, 2, 2, 0]
        assert not any(traceback for _, _, traceback in rank_results)
        errors = [lines for _, lines, _ in rank_results]
        # Every rank stops with exit code 2, the job prints the line once: rank 0 in this harness, which has no
        # torchrun store (under torchrun the first rank to fail prints it).
        once = (lambda line: [line]) if rank == 0 else (lambda line: [])
        assert errors[3] == once("error: reward 'nan_on_rank1' returned 1 non-finite values")
        assert errors[4] == once("error: tp=3 does not divide the world size 2")
        assert errors[0] == errors[1] == errors[2] == errors[5] == []
    _check_run_dir(root / "wan2", 3)
    assert os.listdir(root / "nan" / "checkpoints") == []
    assert not (root / "tp3").exists()


def test_world2_background_scoring_is_the_synchronous_run_and_its_errors_stop_every_rank(world2_runs):
    root, results = world2_runs
    for rank, rank_results in enumerate(results):
        assert [(code, lines) for code, lines, _ in rank_results[6:8]] == [(0, []), (0, [])]
        code, lines, traceback = rank_results[8]
        printed = ["error: reward 'nan_on_rank1' returned 1 non-finite values"] if rank == 0 else []  # once per job
        assert (code, lines, traceback) == (2, printed, False)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VARYING)} for r in rows]
    assert strip(_rows(root / "bg_async")) == strip(_rows(root / "bg_sync")) and len(_rows(root / "bg_sync")) == 2
    mine = model_tensors(root / "bg_async" / "checkpoints" / "step_2")
    ref = model_tensors(root / "bg_sync" / "checkpoints" / "step_2")
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert (root / "bg_async" / "samples" / "step_2.png").read_bytes() == \
        (root / "bg_sync" / "samples" / "step_2.png").read_bytes()
    assert os.listdir(root / "bg_nan" / "checkpoints") == []


def test_fsdp_resume_at_world2_is_bit_identical(world2_runs):
    root, _ = world2_runs
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(VARYING)} for r in rows]
    assert strip(_rows(root / "resumed")) == strip(_rows(root / "wan2"))
    mine = model_tensors(root / "resumed" / "checkpoints" / "step_3")
    ref = model_tensors(root / "wan2" / "checkpoints" / "step_3")
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    optim = [stored_tensors(r / "checkpoints" / "step_3", "optim/") for r in (root / "resumed", root / "wan2")]
    assert optim[0].keys() == optim[1].keys() and any(k.endswith("exp_avg_sq") for k in optim[1])
    assert all(torch.equal(optim[0][k], optim[1][k]) for k in optim[1])


def test_tp2_lora_checkpoint_resumes_at_tp1(world2_runs, tmp_path, capsys):
    root, _ = world2_runs
    reference = _train_here(TINY["flux"], tmp_path / "ref", *LORA, *SMOOTH)
    rows, log = _resume_here(root / "tp2", tmp_path / "run", capsys, *LORA, *SMOOTH)
    assert "resharding checkpoint written at world size 2 (tp 2) to world size 1 (tp 1)" in log
    assert [r["step"] for r in rows] == [1, 2, 3]
    for mine, ref in zip(rows, reference):
        assert mine["reward_mean"] == pytest.approx(ref["reward_mean"], rel=1e-4)
    # The adapters' gradients are ~1e-7 here (B starts at zero) and AdamW normalises them, turning TP=2's rounding
    # of them into weight differences of a few 1e-6 over the 3 steps (lr 1e-3 moves a weight by up to 3e-3); a
    # resharding error would move them by the size of a step.
    _close_weights(tmp_path / "run" / "checkpoints" / "step_3", tmp_path / "ref" / "checkpoints" / "step_3",
                   rtol=1e-4, atol=1e-5)
    ema = stored_tensors(tmp_path / "run" / "checkpoints" / "step_3", "ema/")
    assert all("lora_" in name for name in ema) and ema
