"""At world size 2: background checkpoints publish themselves, and a failed write (of a background checkpoint on
every rank, of a sample grid on rank 0 alone) stops every rank with exit code 2 instead of leaving the others
waiting in the next collective."""

import contextlib
import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.checkpoint import manifest as ckpt_manifest
from leangrpo_mcore.engine.checkpoint import save as ck
from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
ENOSPC = "No space left on device"


def _main(argv: list[str]) -> tuple[int, list[str]]:
    stream = io.StringIO()
    with contextlib.redirect_stderr(stream):
        code = train_main(argv)
    return code, [line for line in stream.getvalue().splitlines() if line.startswith("error:") or "Traceback" in line]


CONTROL = ("raise_if_any", "agreed", "poll", "agree_after_step")
"""The functions that make the trainer's small per-step all-reduces (flags, not tensors of the model)."""


@contextlib.contextmanager
def _control_all_reduces():
    """Count the all-reduces made from :data:`CONTROL` functions once the first step has begun, by caller."""
    import sys

    import torch.distributed as dist

    from leangrpo_mcore.engine import trainer

    counts: dict[str, int] = {}
    began = []
    real_all_reduce, real_step = dist.all_reduce, trainer.Trainer._train_step

    def counting(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_name
        if began and caller in CONTROL:
            counts[caller] = counts.get(caller, 0) + 1
        return real_all_reduce(*args, **kwargs)

    def stepping(self, step):
        began.append(step)
        return real_step(self, step)

    dist.all_reduce, trainer.Trainer._train_step = counting, stepping
    try:
        yield counts
    finally:
        dist.all_reduce, trainer.Trainer._train_step = real_all_reduce, real_step


def _ranks(rank, world_size, root):
    from PIL import Image

    torch.set_num_threads(1)
    common = ["--config", TINY_FLUX, "train.max_steps=4", "checkpoint.save_every=2"]
    with _control_all_reduces() as counts:
        results = [_main([*common, f"train.output_dir={root}/async", "checkpoint.async_save=true"])]
    results.append(counts)
    real_dcp_save = ck._dcp_save

    def full_disk(state, folder, group):
        raise OSError(errno.ENOSPC, ENOSPC, os.path.join(folder, f"__{rank}_0.distcp"))

    ck._dcp_save = full_disk
    try:
        results.append(_main([*common, f"train.output_dir={root}/async_full", "checkpoint.async_save=true"]))
    finally:
        ck._dcp_save = real_dcp_save
    real_save = Image.Image.save

    def png_full(self, fp, *args, **kwargs):
        if isinstance(fp, str):
            raise OSError(errno.ENOSPC, ENOSPC)
        return real_save(self, fp, *args, **kwargs)

    Image.Image.save = png_full
    try:
        results.append(_main([*common, f"train.output_dir={root}/png_full", "logging.sample_every=2"]))
    finally:
        Image.Image.save = real_save
    return results


def test_world2_background_saves_and_write_failures_stop_every_rank(tmp_path):
    results = run_ranks(_ranks, 2, str(tmp_path), timeout=300)
    for rank, (done, counts, async_full, png_full) in enumerate(results):
        assert done == (0, []), (rank, done)
        # per step one all-reduce for the reward's error flag and one for the signal, the failed-write flag and
        # the background write together (not one each)
        assert counts == {"raise_if_any": 4, "agree_after_step": 4}, (rank, counts)
        assert async_full[0] == 2 and png_full[0] == 2, (rank, async_full, png_full)
        if rank == 0:  # the job's one line (rank 0 in this harness, which has no torchrun store)
            assert len(async_full[1]) == 1 and async_full[1][0].endswith(f"/dcp/__0_0.distcp: {ENOSPC}")
            png = tmp_path / "png_full" / "samples" / "step_2.png"
            assert png_full[1] == [f"error: cannot write {png}: {ENOSPC}; the checkpoint of step 2 was saved"]
        else:
            assert async_full[1] == [] and png_full[1] == []
    for step in (2, 4):
        assert ckpt_manifest.verify(str(tmp_path / "async" / "checkpoints" / f"step_{step}")) is None
    rows = [json.loads(line)["step"] for line in (tmp_path / "async_full" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3] and os.listdir(tmp_path / "async_full" / "checkpoints") == []
    assert sorted(os.listdir(tmp_path / "png_full" / "checkpoints")) == ["step_2"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
