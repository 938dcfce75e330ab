"""A world-size-2 FSDP2 checkpoint continues at world size 1, at TP=2 and at CP=2 as the world-size-2 run does,
and a CP=2 checkpoint continues at world size 1 as the CP=2 run does.

The reference run trains 3 steps at world size 2 (FSDP2 over both ranks) and saves after steps 2 and 3. Its step-2
checkpoint is then resumed at world size 1, at ``parallel.tp=2`` and at ``parallel.cp=2`` (2 ranks, no data
parallelism); the weights after step 3 must equal the reference's within 1e-5 relative (fp32), and the update of
step 3 must point the same way. The other direction starts from a 3-step ``parallel.cp=2`` reference (FSDP2 over
the two CP ranks, each holding half of every sample's tokens). The reward is smooth in the pixels: layouts differ
by fp32 rounding, which a JPEG size can turn into different advantages.
"""

import shutil
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from tests.ckpt_helpers import model_tensors
from tests.distributed.launcher import train_ranks
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
COMMON = ("reward.name=tests.unit.test_precision:contrast", "checkpoint.save_every=2", "train.max_steps=3",
          "logging.progress_bar=false", "logging.tensorboard=false")


def _train(run: Path, *overrides: str) -> None:
    train_ranks("--config", TINY_FLUX, f"train.output_dir={run}", *COMMON, *overrides)


def _flat(tensors: dict) -> torch.Tensor:
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])


@pytest.fixture(scope="module")
@once_per_process
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ws2") / "run"
    _train(run)
    return run


def _resumed_copy(reference: Path, dst: Path) -> Path:
    shutil.copytree(reference, dst)
    shutil.rmtree(dst / "checkpoints" / "step_3")
    return dst


def _check(reference: Path, resumed: Path) -> None:
    before = _flat(model_tensors(reference / "checkpoints" / "step_2"))
    ref, mine = (_flat(model_tensors(r / "checkpoints" / "step_3")) for r in (reference, resumed))
    assert float((mine - ref).norm() / ref.norm()) <= 1e-5
    update_ref, update_mine = ref - before, mine - before
    assert float(update_ref.norm()) > 0
    cosine = float(update_mine @ update_ref / (update_mine.norm() * update_ref.norm()))
    assert cosine >= 0.999, cosine


def test_resume_at_world_size_1(reference, tmp_path):
    run = _resumed_copy(reference, tmp_path / "ws1")
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", *COMMON,
                       f"checkpoint.resume={run / 'checkpoints' / 'step_2'}"]) == 0
    _check(reference, run)


def test_resume_at_tp2(reference, tmp_path):
    run = _resumed_copy(reference, tmp_path / "tp2")
    _train(run, "parallel.tp=2", f"checkpoint.resume={run / 'checkpoints' / 'step_2'}")
    _check(reference, run)


def test_resume_at_cp2(reference, tmp_path):
    """The data-parallel checkpoint continues with each sample's tokens split over 2 ranks (cp 1 -> 2)."""
    run = _resumed_copy(reference, tmp_path / "cp2")
    _train(run, "parallel.cp=2", f"checkpoint.resume={run / 'checkpoints' / 'step_2'}")
    _check(reference, run)


@pytest.fixture(scope="module")
@once_per_process
def cp_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("cp2") / "run"
    _train(run, "parallel.cp=2")
    return run


def test_cp2_checkpoint_resumes_at_world_size_1(cp_reference, tmp_path):
    """cp 2 -> 1: the shards of the two CP ranks are one FSDP2 shard group; one rank takes them all."""
    run = _resumed_copy(cp_reference, tmp_path / "ws1")
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", *COMMON,
                       f"checkpoint.resume={run / 'checkpoints' / 'step_2'}"]) == 0
    _check(cp_reference, run)


def test_hsdp_checkpoint_resumes_at_world_size_1(tmp_path):
    reference = tmp_path / "hsdp"
    _train(reference, "parallel.dp_replicate=2", "parallel.dp_shard=1")  # replicas: each box written once
    run = _resumed_copy(reference, tmp_path / "ws1")
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", *COMMON,
                       f"checkpoint.resume={run / 'checkpoints' / 'step_2'}"]) == 0
    _check(reference, run)
