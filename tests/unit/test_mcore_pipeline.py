"""The training forwards/backwards run by megatron-core's pipeline scheduler at pipeline size 1 (CPU)."""

from __future__ import annotations

import megatron.core.pipeline_parallel as mcore_pp
import torch

from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.mesh import Layout, ParallelContext
from leangrpo_mcore.parallel.pipeline import run_micro_batches, token_count
from leangrpo_mcore.schedules.base import PhaseTimer
from tests.unit.test_schedules_parity import Case, run_case


def _spy(monkeypatch) -> list[int]:
    """Record ``num_microbatches`` of every call of the function megatron's ``get_forward_backward_func`` returns."""
    calls: list[int] = []
    real = mcore_pp.get_forward_backward_func

    def get(*args, **kwargs):
        inner = real(*args, **kwargs)

        def counted(**call):
            calls.append(call["num_microbatches"])
            return inner(**call)

        return counted

    monkeypatch.setattr(mcore_pp, "get_forward_backward_func", get)
    return calls


def test_native_units_are_megatron_micro_batches(monkeypatch):
    calls = _spy(monkeypatch)
    case = Case(schedule="native", group_size=2, prompts=2, num_steps=4)  # int(4 · 0.99) = 3 selected steps
    run_case(case)
    assert calls == [2 * 3, 2 * 3]  # one scheduler call per group: 2 samples × 3 selected steps


def test_retain_and_reweight_backwards_are_megatron_micro_batches(monkeypatch):
    calls = _spy(monkeypatch)
    case = Case(schedule="retain", group_size=2, prompts=2, num_steps=4)
    run_case(case)
    assert calls == [2 * 3, 2 * 3]  # the kept graphs of each group: one scheduler call per group
    calls.clear()
    run_case(case.but(schedule="reweight"))
    assert calls == [1] * (2 * 2 * 3)  # each (sample, step)'s immediate backward, as it happens
    calls.clear()
    run_case(case.but(schedule="reweight", family="wan", lora=True, kl_beta=20.0))
    assert calls == [1] * (2 * 2 * 3)  # the KL part keeps its graph for the second backward: not a micro-batch


def test_scheduler_gradients_and_phases_match_a_plain_loop():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    inputs = [torch.randn(4, 5) for _ in range(3)]
    weight = 1.0 / 7.0

    for x in inputs:
        (model(x).square().sum() * weight).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    timer = PhaseTimer()
    seen = []

    def forward_step(data_iterator, stage):
        out = model(next(data_iterator))

        def loss_func(output):
            loss = output.square().sum() * weight
            seen.append(loss.detach())
            return loss, token_count(), {"loss": loss.detach()}

        return out, loss_func

    sync = GradSync(model, ParallelContext(layout=Layout().resolve(1)))
    reduced = run_micro_batches(forward_step, inputs, sync, phase=timer.phase,
                                phases={"forward-compute": "recompute", "backward-compute": "backward"})
    assert len(reduced) == len(seen) == 3
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad, e)  # bitwise: megatron neither divides by 3 nor rescales
    assert set(timer.totals) == {"recompute", "backward"}
    assert timer.totals["recompute"] > 0 and timer.totals["backward"] > 0

