"""Training checkpoints on one process: complete round trip, atomicity, discovery, incompatibility errors."""

import os
import random

import numpy as np
import pytest
import torch

from leangrpo_mcore.engine import checkpoint as ck
from leangrpo_mcore.engine.run_dir import RunDir
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.common.checkpoint import read_policy_checkpoint

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


def _save(run_dir, step, model, layout, optimizer, scheduler, ema):
    return ck.save_checkpoint(run_dir, step, model=model, optimizer=optimizer, lr_scheduler=scheduler, ema=ema,
                              layout=layout, state={"sampler": {"epoch": 1, "offset": 3}, "world_size": 1},
                              config_yaml="train:\n  max_steps: 3\n")


def test_round_trip_continues_bit_identically(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, ema = _train_state(0)
    for step in range(2):
        _sgd_like_step(model, optimizer, scheduler, ema, step)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(run_dir, 2, model, layout, optimizer, scheduler, ema)
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(())))
    assert sorted(os.listdir(path)) == sorted(["COMPLETE", "config.yaml", "ema.safetensors", "leangrpo_model.json",
                                               "model.safetensors", "optimizer.pt", "rng", "trainer_state.json"])

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


def test_incompatible_checkpoint_is_a_user_error(tmp_path):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir)
    model, layout, optimizer, scheduler, _ = _train_state(0)
    path = _save(run_dir, 1, model, layout, optimizer, scheduler, None)
    wider = build_policy({**TINY, "joint_attention_dim": 40}, seed=0, backend="local")
    with pytest.raises(UserError, match=r"incompatible: '.*' has shape"):
        ck.load_model_state(path, wider, ck.capture_tp_layout(wider))
    with open(os.path.join(path, ck.STATE_FILE), "w") as fh:
        fh.write("{not json")
    with pytest.raises(UserError, match="unreadable"):
        ck.read_state(path)
