"""Publishing a checkpoint: a background write publishes itself as soon as its files are written, a failed one is
reported by the next poll, and a crash between the renames that publish a checkpoint never loses it."""

import errno
import os
import shutil
import time

import pytest
import torch

from leangrpo_mcore.engine import checkpoint as ck
from leangrpo_mcore.engine.checkpoint import save as ck_save
from leangrpo_mcore.engine.output import run_dir as rd
from leangrpo_mcore.errors import UserError
from tests.ckpt_helpers import model_tensors
from tests.unit.test_checkpoint import _save, _sgd_like_step, _train_state


def _wait(pending: ck.PendingSave) -> None:
    """Wait for a background write the way a crash would see it: without finish() or poll()."""
    deadline = time.monotonic() + 60
    while not pending.future.done():
        assert time.monotonic() < deadline, "the background write did not end"
        time.sleep(0.01)


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_background_write_is_published_without_waiting_for_the_next_save(tmp_path):
    run = rd.RunDir(str(tmp_path / "run"))
    os.makedirs(run.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    _sgd_like_step(model, optimizer, scheduler, ema, 0)
    expected = _weights(model)
    pending = ck.save_checkpoint(run, 1, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=None,
                                 layout=layout, state={"sampler": {}}, config_yaml="", async_save=True)
    _sgd_like_step(model, optimizer, scheduler, ema, 1)
    _wait(pending)
    # The process dies here (nobody calls finish or poll): the checkpoint is in place and verifies.
    del pending
    assert os.listdir(run.checkpoints_dir) == ["step_1"]
    rd.remove_unfinished(run)
    path = ck.resolve_resume("auto", run)
    assert path == run.checkpoint_path(1)
    saved = model_tensors(path)
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    other, layout2, opt2, sched2, _ = _train_state(1)
    state = ck.load_checkpoint(path, model=other, optimizer=opt2, lr_scheduler=sched2, ema=None, layout=layout2,
                               same_layout=True)
    assert state["step"] == 1
    assert all(torch.equal(p, expected[n]) for n, p in other.named_parameters())


def test_failed_background_write_is_one_line_at_the_next_poll(tmp_path, monkeypatch):
    run = rd.RunDir(str(tmp_path / "run"))
    os.makedirs(run.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)

    def full_disk(state, folder, group):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "__0_0.distcp"))

    monkeypatch.setattr(ck_save, "_dcp_save", full_disk)
    pending = ck.save_checkpoint(run, 2, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=None,
                                 layout=layout, state={"sampler": {}}, config_yaml="", async_save=True)
    _wait(pending)
    with pytest.raises(UserError, match=r"^cannot write checkpoint: .*step_2\.tmp-\w+/dcp/__0_0\.distcp: "
                                        r"No space left on device$"):
        pending.poll()
    assert os.listdir(run.checkpoints_dir) == []


def _crash_between_renames(run, model, layout, optimizer, scheduler, monkeypatch):
    """Re-save step 2 and die between the two renames that replace the old copy."""
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(dst) == "step_2":  # the new copy into place: a kill leaves the old one moved aside
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _save(run, 2, model, layout, optimizer, scheduler, None)
    monkeypatch.setattr(os, "rename", real_rename)
    names = sorted(os.listdir(run.checkpoints_dir))
    assert "step_2" not in names and len(names) == 2
    new = next(n for n in names if ".tmp-replaced-" not in n)
    old = next(n for n in names if ".tmp-replaced-" in n)
    return os.path.join(run.checkpoints_dir, new), os.path.join(run.checkpoints_dir, old)


@pytest.mark.parametrize("new_copy", ["intact", "damaged", "gone"])
def test_a_crash_between_the_publishing_renames_keeps_the_checkpoint(tmp_path, monkeypatch, new_copy):
    run = rd.RunDir(str(tmp_path / "run"))
    os.makedirs(run.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    _save(run, 2, model, layout, optimizer, scheduler, None)
    first = _weights(model)
    _sgd_like_step(model, optimizer, scheduler, ema, 5)
    second = _weights(model)
    new, old = _crash_between_renames(run, model, layout, optimizer, scheduler, monkeypatch)
    if new_copy == "damaged":
        with open(os.path.join(new, "dcp", "__0_0.distcp"), "r+b") as fh:
            fh.truncate(100)
    elif new_copy == "gone":
        shutil.rmtree(new)
    # A fresh run sees a checkpoint there; the cleanup of a launch deletes neither complete copy.
    with pytest.raises(UserError, match="already holds checkpoints"):
        rd.check_fresh_run(run)
    assert rd.remove_unfinished(run) == []
    warnings = []
    assert ck.resolve_resume("auto", run, warn=warnings.append) == run.checkpoint_path(2)
    expected = second if new_copy == "intact" else first
    saved = model_tensors(run.checkpoint_path(2))
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert any("restored from" in w for w in warnings)
    assert (new_copy == "damaged") == any("is damaged" in w and "__0_0.distcp" in w for w in warnings)
    # Once step_2 is back, the other copy is what the publish was about to delete.
    rd.remove_unfinished(run)
    names = sorted(os.listdir(run.checkpoints_dir))
    assert names[0] == "step_2" and all(".tmp-" not in n for n in names)
    assert len(names) == (2 if new_copy == "damaged" else 1)  # the damaged copy is set aside, not deleted


def test_unfinished_writes_are_still_removed(tmp_path):
    run = rd.RunDir(str(tmp_path / "run"))
    os.makedirs(run.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    _save(run, 2, model, layout, optimizer, scheduler, None)
    os.makedirs(os.path.join(run.checkpoints_dir, "step_4.tmp-0badc0de", "dcp"))  # no marker: unfinished
    shutil.copytree(run.checkpoint_path(2), os.path.join(run.checkpoints_dir, "step_2.tmp-replaced-1234abcd"))
    removed = sorted(os.path.basename(p) for p in rd.remove_unfinished(run))
    assert removed == ["step_2.tmp-replaced-1234abcd", "step_4.tmp-0badc0de"]
    assert os.listdir(run.checkpoints_dir) == ["step_2"]
