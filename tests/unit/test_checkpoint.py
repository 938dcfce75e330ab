"""Training checkpoints on one process: round trip, atomicity, verification, discovery, resume semantics and the
failure paths (damaged files, full disk, non-finite state, incompatible models)."""

import errno
import json
import os
import random

import numpy as np
import pytest
import torch

from leangrpo_mcore.engine import checkpoint as ck
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.common.checkpoint import read_policy_checkpoint
from tests.ckpt_helpers import model_tensors

TINY = {"family": "flux", "preset": "flux-tiny"}


def _train_state(seed: int):
    torch.manual_seed(seed)
    model = build_policy(TINY, seed=seed, backend="local")
    layout = ck.capture_tp_layout(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    ema = {name: p.detach().clone().float() for name, p in model.named_parameters()}
    return model, layout, optimizer, scheduler, ema


def _sgd_like_step(model, optimizer, scheduler, ema, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    with torch.no_grad():
        for name, p in model.named_parameters():
            ema[name].lerp_(p.float(), 0.1)


def _save(run_dir, step, model, layout, optimizer, scheduler, ema, async_save=False):
    pending = ck.save_checkpoint(run_dir, step, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=ema,
                                 layout=layout, state={"sampler": {"epoch": 1, "offset": 3}, "world_size": 1},
                                 config_yaml="train:\n  max_steps: 3\n", async_save=async_save)
    return pending.finish()


def _load(path, model, layout, optimizer, scheduler, ema=None):
    return ck.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=ema,
                              layout=layout, same_layout=True)


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_continues_bit_identically(tmp_path, async_save):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    for step in range(2):
        _sgd_like_step(model, optimizer, scheduler, ema, step)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(run_dir, 2, model, layout, optimizer, scheduler, ema, async_save=async_save)
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert sorted(os.listdir(path)) == sorted(["COMPLETE", "config.yaml", "dcp", "leangrpo_model.json",
                                               "optimizer.json", "rng", "trainer_state.json"])
    listed = json.loads(open(os.path.join(path, "COMPLETE")).read())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rng/rank_0.pt", "optimizer.json"} <= set(listed)

    other, layout2, opt2, sched2, ema2 = _train_state(1)
    assert not torch.equal(next(other.parameters()), next(model.parameters()))
    state = ck.load_checkpoint(path, model=other, optimizer=opt2, lr_scheduler=sched2, ema=ema2, layout=layout2,
                               same_layout=True)
    assert state["step"] == 2 and state["sampler"] == {"epoch": 1, "offset": 3}
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected_draws
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    assert sched2.get_last_lr() == scheduler.get_last_lr()
    _sgd_like_step(model, optimizer, scheduler, ema, 9)
    _sgd_like_step(other, opt2, sched2, ema2, 9)
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(ema[name], ema2[name]), name
    assert opt2.state[next(other.parameters())]["step"].item() == 3.0

    meta, source = read_policy_checkpoint(path)
    assert meta["family"] == "flux" and meta["lora"] is None
    assert set(source.keys()) == {name for name, _ in model.named_parameters()}


def test_saved_tensors_are_the_weights_at_save_time(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    _sgd_like_step(model, optimizer, scheduler, ema, 0)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    pending = ck.save_checkpoint(run_dir, 1, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=None,
                                 layout=layout, state={"sampler": {}}, config_yaml="", async_save=True)
    _sgd_like_step(model, optimizer, scheduler, ema, 1)  # the background write must not see this update
    saved = model_tensors(pending.finish())
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    assert not all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def test_auto_resume_skips_incomplete_and_temporary(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    model, layout, optimizer, scheduler, ema = _train_state(0)
    os.makedirs(run_dir.checkpoints_dir)
    assert ck.resolve_resume("auto", run_dir) is None
    _save(run_dir, 2, model, layout, optimizer, scheduler, None)
    os.makedirs(os.path.join(run_dir.checkpoints_dir, "step_4.tmp-deadbeef"))
    os.makedirs(os.path.join(run_dir.checkpoints_dir, "step_6"))  # no marker: a foreign or broken copy
    os.makedirs(os.path.join(run_dir.checkpoints_dir, "step_10"))
    _save(run_dir, 3, model, layout, optimizer, scheduler, None)
    assert [step for step, _ in ck.list_complete(run_dir)] == [2, 3]
    assert ck.resolve_resume("auto", run_dir) == run_dir.checkpoint_path(3)
    assert not any(".tmp-" in name for name in os.listdir(run_dir.checkpoints_dir) if name.startswith("step_3"))
    with pytest.raises(UserError, match="not a complete checkpoint"):
        ck.resolve_resume(os.path.join(run_dir.checkpoints_dir, "step_6"), run_dir)
    with pytest.raises(UserError, match="no such checkpoint"):
        ck.resolve_resume(str(tmp_path / "nowhere"), run_dir)
    assert ck.prune(run_dir, keep_last=1) == [run_dir.checkpoint_path(2)]
    assert [step for step, _ in ck.list_complete(run_dir)] == [3]


def _damage(path: str, rel: str, how: str) -> None:
    target = os.path.join(path, rel)
    if how == "truncate":
        with open(target, "r+b") as fh:
            fh.truncate(os.path.getsize(target) // 2)
    elif how == "empty":
        open(target, "wb").close()
    else:  # flip one byte in the middle: same size, different content
        with open(target, "r+b") as fh:
            fh.seek(os.path.getsize(target) // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("rel,how", [("dcp/__0_0.distcp", "flip"), ("dcp/__0_0.distcp", "truncate"),
                                     ("dcp/.metadata", "empty"), ("rng/rank_0.pt", "empty"),
                                     ("optimizer.json", "truncate")])
def test_damaged_checkpoint_is_skipped_by_auto_and_refused_by_path(tmp_path, rel, how):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    good = _save(run_dir, 1, model, layout, optimizer, scheduler, None)
    bad = _save(run_dir, 2, model, layout, optimizer, scheduler, None)
    _damage(bad, rel, how)
    with pytest.raises(UserError, match=f"fails verification: {rel}"):
        ck.resolve_resume(bad, run_dir)
    warnings = []
    assert ck.resolve_resume("auto", run_dir, warn=warnings.append) == good
    assert len(warnings) == 1 and "is damaged" in warnings[0] and rel in warnings[0]
    assert [p for _, p in ck.list_complete(run_dir)] == [good]  # set aside: never resumed, never pruned
    assert any(name.startswith("step_2.damaged-") for name in os.listdir(run_dir.checkpoints_dir))


def test_prune_keeps_the_checkpoint_just_written(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    paths = [_save(run_dir, step, model, layout, optimizer, scheduler, None) for step in (2, 4, 6)]
    resumed = _save(run_dir, 3, model, layout, optimizer, scheduler, None)  # a run resumed from step 2
    assert ck.prune(run_dir, keep_last=2, newest=resumed) == paths[:2]
    assert [p for _, p in ck.list_complete(run_dir)] == [resumed, paths[2]]
    assert ck.prune(run_dir, keep_last=1, newest=resumed) == [paths[2]]


@pytest.mark.parametrize("code,text", [(errno.ENOSPC, "No space left on device"), (errno.EACCES, "Permission denied")])
def test_write_failure_is_one_line_naming_the_file_and_leaves_nothing(tmp_path, monkeypatch, code, text):
    import pathlib

    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    real_open = pathlib.Path.open

    def full_open(self, mode="r", *args, **kwargs):
        if self.name.endswith(".distcp") and "w" in mode:
            raise OSError(code, text, str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", full_open)
    with pytest.raises(UserError, match=rf"cannot write checkpoint: .*__0_0\.distcp: {text}$"):
        _save(run_dir, 1, model, layout, optimizer, scheduler, None)
    monkeypatch.undo()
    assert os.listdir(run_dir.checkpoints_dir) == []


def test_non_finite_weights_are_refused(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    name, param = next(iter(model.named_parameters()))
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    path = _save(run_dir, 1, model, layout, optimizer, scheduler, None)
    other, layout2, opt2, sched2, _ = _train_state(1)
    with pytest.raises(UserError, match=f"holds non-finite values in '{name}'"):
        _load(path, other, layout2, opt2, sched2)


def test_resume_applies_this_runs_learning_rate_at_the_saved_position(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    for step in range(3):
        _sgd_like_step(model, optimizer, scheduler, ema, step)
    path = _save(run_dir, 3, model, layout, optimizer, scheduler, None)
    other, layout2, _, _, _ = _train_state(1)
    params = [p for p in other.parameters() if p.requires_grad]
    opt2 = torch.optim.AdamW(params, lr=5e-3, betas=(0.8, 0.9), weight_decay=0.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0 / (1 + step))
    _load(path, other, layout2, opt2, sched2)
    group = opt2.param_groups[0]
    assert group["lr"] == pytest.approx(5e-3 / 4) and sched2.last_epoch == 3
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.0
    assert opt2.state[params[0]]["step"].item() == 3.0


def test_incompatible_checkpoint_is_a_user_error(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    path = _save(run_dir, 1, model, layout, optimizer, scheduler, None)
    wider = build_policy({**TINY, "joint_attention_dim": 40}, seed=0, backend="local")
    opt = torch.optim.AdamW(list(wider.parameters()), lr=1e-2)
    with pytest.raises(UserError, match=r"incompatible: '.*' has shape"):
        _load(path, wider, ck.capture_tp_layout(wider), opt, None)
    with open(os.path.join(path, ck.STATE_FILE), "w") as fh:
        fh.write("{not json")
    with pytest.raises(UserError, match="unreadable"):
        ck.read_state(path)
