"""Pure pieces of the scheduler: sample layouts, advantage bounds, plans, loss, gradient slots, clipping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from leangrpo_mcore.diffusion.sampler import SDEParams
from leangrpo_mcore.diffusion.sigmas import get_sigmas
from leangrpo_mcore.engine.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from leangrpo_mcore.engine.step import StepPlan
from leangrpo_mcore.schedules.base import PhaseTimer
from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.groups import assign_samples, check_layout, gather_rank_sets
from leangrpo_mcore.parallel.mesh import Layout, ParallelContext
from leangrpo_mcore.rl.advantages import compute_advantages
from leangrpo_mcore.schedules import Objective, loss_weight, max_abs_advantage, plan_reweight, unit_loss
from leangrpo_mcore.config.schema import OptimConfig


@pytest.mark.parametrize("layout,ranks,group,prompts", [
    ("shared", 2, 4, 2), ("shared", 4, 4, 1), ("shared", 4, 2, 4), ("shared", 8, 2, 4), ("conventional", 2, 3, 4),
])
def test_every_sample_is_made_exactly_once(layout, ranks, group, prompts):
    made = [(share.prompt_slot, g, tuple(share.group_ranks)) for r in range(ranks)
            for share in assign_samples(layout, r, ranks, group, prompts) for g in share.generation_ids]
    assert sorted((p, g) for p, g, _ in made) == list(itertools.product(range(prompts), range(group)))
    counts = [sum(len(s.generation_ids) for s in assign_samples(layout, r, ranks, group, prompts)) for r in range(ranks)]
    assert len(set(counts)) == 1  # balanced: every rank runs the same number of forwards (collectives match)


def test_shared_layout_details():
    share = assign_samples("shared", 1, 2, 4, 1)[0]
    assert share.generation_ids == (1, 3) and share.group_ranks == (0, 1)  # m = q·R + r
    assert share.gathered_generation_ids(4) == [[0, 2], [1, 3]]
    workers = assign_samples("shared", 3, 4, 2, 2)  # M < R: worker groups {0,1} and {2,3}
    assert [(s.prompt_slot, s.generation_ids, s.group_ranks) for s in workers] == [(1, (1,), (2, 3))]
    assert gather_rank_sets("shared", 4, 2) == [(0, 1), (2, 3)] and gather_rank_sets("conventional", 4, 2) == []
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        check_layout("shared", 4, 6, 1)
    with pytest.raises(ValueError, match="prompts_per_step"):
        check_layout("conventional", 2, 4, 3)


def test_layout_resolution():
    assert Layout(tp=2).resolve(8) == Layout(tp=2, dp_replicate=1, dp_shard=4)
    assert Layout(tp=1, dp_replicate=2).resolve(8) == Layout(tp=1, dp_replicate=2, dp_shard=4)
    with pytest.raises(ValueError, match="does not divide"):
        Layout(tp=3).resolve(4)
    with pytest.raises(ValueError, match="world size"):
        Layout(tp=1, dp_shard=3).resolve(4)


def test_advantage_bounds_hold_and_are_tight():
    gen = torch.Generator().manual_seed(0)
    for advantage in ("flow_grpo", "dance_grpo"):
        for m in (2, 3, 5, 8):
            rewards = [torch.randn(m, generator=gen) ** 3 for _ in range(200)]
            rewards.append(torch.tensor([1.0] + [0.0] * (m - 1)))  # the extreme case
            worst = max(float(compute_advantages(advantage, r, torch.zeros(m, dtype=torch.long),
                                                 adv_clip_max=None).abs().max()) for r in rewards)
            bound = max_abs_advantage(advantage, m)
            assert 0.99 * bound < worst <= bound * (1 + 1e-6)  # advantages come back as float32
        table = torch.randn(4, 3, generator=gen) * torch.tensor([[1.0], [5.0], [0.1], [2.0]])
        ids = torch.arange(4).repeat_interleave(3)
        worst = float(compute_advantages(advantage, table.flatten(), ids, adv_clip_max=None, global_std=True).abs().max())
        assert worst <= max_abs_advantage(advantage, 3, 12) * (1 + 1e-6)
    assert math.isclose(max_abs_advantage("flow_grpo", 26), 5.0)


def test_reweight_plans():
    assert plan_reweight("affine", advantage="flow_grpo", group_size=26, prompts_per_step=1, adv_clip_max=5.0,
                         global_std=False).accumulate == "affine"
    fallback = plan_reweight("affine", advantage="flow_grpo", group_size=27, prompts_per_step=1, adv_clip_max=5.0,
                             global_std=False)
    assert fallback.accumulate == "per_sample" and "clamp may fire" in fallback.note
    fold = plan_reweight("per_sample", advantage="flow_grpo", group_size=4, prompts_per_step=2, adv_clip_max=5.0,
                         global_std=True)
    assert fold.global_fold
    assert not plan_reweight("per_sample", advantage="flow_grpo", group_size=4, prompts_per_step=2, adv_clip_max=2.0,
                             global_std=True).global_fold


def _plan(**kw) -> StepPlan:
    sigmas = get_sigmas("sd3", 4)
    args = dict(schedule="retain", group_size=2, prompts_per_step=2, latent_shape=(2, 2), sigmas=sigmas,
                sde=SDEParams.from_sigmas("flow_grpo", 0.7, sigmas), objective=Objective(),
                selection={"method": "flow_grpo", "fraction": 0.99})
    args.update(kw)
    return StepPlan(**args)


@pytest.mark.parametrize("kw,match", [
    ({"schedule": "auto"}, "planner"),
    ({"selection": {"method": "dance_grpo", "fraction": 0.6}, "micro_batch": 2}, "micro_batch=1"),
    ({"updates_per_rollout": 3}, "must divide"),
    ({"selection": {"method": "flow_grpo", "fraction": 0.99, "window_size": 2}}, "sde_window"),
    ({"objective": Objective(kl_beta=0.1)}, "needs LoRA"),
    ({"sync": "sometimes"}, "unknown gradient sync"),
])
def test_plan_refuses_inexact_or_inconsistent_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw).validate(ParallelContext(layout=Layout().resolve(1)), torch.nn.Linear(2, 2))


def test_plan_derived_values():
    plan = _plan(updates_per_rollout=2, prompts_per_step=4, group_size=3)
    assert plan.steps_per_sample == 3 and plan.samples_per_update == 6
    assert [plan.update_of(p) for p in range(4)] == [0, 0, 1, 1]
    assert plan.sync_mode() == "coalesced" and _plan(schedule="native").sync_mode() == "per_backward"
    assert _plan(schedule="reweight", sync="per_backward").sync_mode() == "coalesced"
    assert loss_weight(6, 3) == 1 / 18


def test_unit_loss_gradient_is_minus_advantage_grad_log_prob():
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    log_prob = theta * torch.tensor([1.0, 2.0, 3.0])
    advantages = torch.tensor([2.0, -1.0, 4.0])
    train = torch.tensor([True, True, False])
    loss, ratio = unit_loss(log_prob, log_prob.detach(), advantages, train, 0.25, Objective(clip_range=1e-4))
    loss.backward()
    assert torch.equal(theta.grad, torch.tensor([-2.0 * 0.25, 1.0 * 2.0 * 0.25, 0.0]))
    assert ratio.tolist() == [1.0, 1.0]


def test_phase_timer_is_exclusive():
    timer = PhaseTimer()
    with timer.phase("rollout"):
        with timer.phase("backward"):
            sum(range(20000))
    assert set(timer.totals) == {"rollout", "backward"} and timer.totals["backward"] > 0
    assert timer.totals["rollout"] >= 0


def test_grad_sync_slots_without_data_parallelism():
    model = torch.nn.Linear(3, 2)
    sync = GradSync(model, ParallelContext(layout=Layout().resolve(1)), mode="coalesced")
    model(torch.ones(1, 3)).sum().backward()
    first = sync.take_local()
    assert model.weight.grad is None and first[0].tolist() == [[1.0] * 3] * 2
    sync.put_local(first)
    with pytest.raises(RuntimeError, match="occupied"):
        sync.put_local(first)
    model(torch.ones(1, 3)).sum().backward()  # accumulates into the installed buffer
    total = sync.take_local()
    assert total[0] is first[0] and first[0].tolist() == [[2.0] * 3] * 2
    sync.reduce_local([g * 3 for g in total])
    model(torch.ones(1, 3)).sum().backward()  # a later local gradient joins at finish
    sync.finish()
    assert model.weight.grad.tolist() == [[7.0] * 3] * 2


def test_clipping_and_optimizers():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm, clipped = clip_grad_norm_(model.parameters(), 0.5, ParallelContext(layout=Layout().resolve(1)))
    assert math.isclose(norm, float(expected), rel_tol=1e-6) and clipped
    assert math.isclose(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])), 0.5, rel_tol=1e-5)
    assert isinstance(build_optimizer(model.parameters(), OptimConfig(name="sgd")), torch.optim.SGD)
    adamw = build_optimizer(model.parameters(), OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine"))
    scheduler = build_lr_scheduler(adamw, OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="cosine"), 6)
    lrs = []
    for _ in range(6):
        lrs.append(adamw.param_groups[0]["lr"])
        adamw.step()
        scheduler.step()
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[3] < 1.0 and lrs[5] < lrs[4]


@pytest.mark.parametrize("layout,dp,prompts,fails", [
    ("conventional", 2, 2, True),   # each rank holds one prompt: one of the two updates has nothing on it
    ("conventional", 2, 4, False),
    ("shared", 4, 2, True),         # 2 worker groups, 1 prompt per update: one group idles in each update
    ("shared", 4, 4, False),
    ("shared", 2, 2, False),        # every prompt is shared by both ranks
])
def test_every_rank_takes_part_in_every_update(layout, dp, prompts, fails):
    from leangrpo_mcore.parallel.groups import check_updates

    if fails:
        with pytest.raises(ValueError, match="holds no sample of update"):
            check_updates(layout, dp, 2, prompts, 2)
    else:
        check_updates(layout, dp, 2, prompts, 2)
        check_updates(layout, dp, 2, prompts, 1)
