"""Gradient routing (``parallel/routing.py``) on one rank: each micro-batch's backward lands in the slot keyed at its
forward, whatever order the backwards run in, and anything else raises RoutingError naming the micro-batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from leangrpo_mcore.parallel.grad_sync import GradSync
from leangrpo_mcore.parallel.mesh import Layout, ParallelContext
from leangrpo_mcore.parallel.pipeline import run_micro_batches, token_count
from leangrpo_mcore.parallel.routing import GradientRouter, RoutingError
from leangrpo_mcore.schedules.base import PhaseTimer
from tests.unit.test_schedules_parity import Case, run_case


def _setup(n: int, seed: int = 1):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    return model, [torch.randn(2, 5) for _ in range(n)], GradSync(model, ParallelContext(layout=Layout().resolve(1)))


def _own_grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``x``'s loss alone, by a plain backward (the independent reference)."""
    model.zero_grad(set_to_none=True)
    model(x).pow(3).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _slots(sync: GradSync):
    """``open_slot`` over a dict of slots (what Reweight's provisional gradients do), and the dict."""
    held: dict = {}

    @contextlib.contextmanager
    def open_slot(key):
        if key in held:
            sync.put_local(held[key])
        yield
        held[key] = sync.take_local()

    return open_slot, held


def _close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.allclose(a, e, rtol=1e-6, atol=1e-7) for a, e in zip(actual, expected))


def test_each_scheduled_backward_lands_in_its_key_slot():
    """megatron's scheduler: micro-batches 0 and 2 share a key (their gradients add up), 1 and 3 have their own."""
    model, inputs, sync = _setup(4)
    own = [_own_grads(model, x) for x in inputs]
    open_slot, held = _slots(sync)
    router = GradientRouter(sync, ["a", "b", "a", "c"], open_slot)

    def forward_step(data_iterator, stage):
        k, x = next(data_iterator)
        return router.route(k, model(x)), lambda out: (out.pow(3).sum(), token_count(), {})

    run_micro_batches(forward_step, list(enumerate(inputs)), sync, phase=PhaseTimer().phase, phases={})
    router.finish()
    assert router.routed == [0, 1, 2, 3]
    assert _close(held["a"], [g0 + g2 for g0, g2 in zip(own[0], own[2])])
    assert _close(held["b"], own[1]) and _close(held["c"], own[3])
    assert all(p.grad is None for p in model.parameters())  # the slot is left empty


def test_routing_follows_the_forward_not_the_backward_order():
    """Backwards in another order than their forwards (an interleaved schedule): each still finds its own slot."""
    model, inputs, sync = _setup(3, seed=2)
    own = [_own_grads(model, x) for x in inputs]
    open_slot, held = _slots(sync)
    router = GradientRouter(sync, ["x", "y", "z"], open_slot)
    losses = [router.route(k, model(x)).pow(3).sum() for k, x in enumerate(inputs)]
    for k in (2, 0, 1):
        losses[k].backward()
    router.finish()
    assert router.routed == [2, 0, 1]
    for k, key in enumerate("xyz"):
        assert _close(held[key], own[k]), key


class _FinishesInCallback(torch.autograd.Function):
    """Identity whose backward queues an engine callback adding 1 to ``weight.grad`` (as FSDP2's root post-backward
    callback finishes the accumulated gradients after the backward's last node)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        torch.autograd.Variable._execution_engine.queue_callback(lambda: weight.grad.add_(1.0))
        return grad, None


def test_the_slot_is_moved_out_after_the_backwards_own_callbacks():
    model, inputs, sync = _setup(2, seed=3)
    own = [_own_grads(model, x) for x in inputs]
    open_slot, held = _slots(sync)
    router = GradientRouter(sync, [0, 1], open_slot)
    for k, x in enumerate(inputs):
        router.route(k, _FinishesInCallback.apply(model(x), model.weight)).pow(3).sum().backward()
    router.finish()
    for k in (0, 1):
        assert torch.allclose(held[k][0], own[k][0] + 1.0, rtol=1e-6) and torch.allclose(held[k][1], own[k][1])


def test_an_unrouted_micro_batch_raises_with_the_count_and_its_key():
    model, inputs, sync = _setup(4, seed=4)
    open_slot, held = _slots(sync)
    router = GradientRouter(sync, [("pg", 0, k, 0) for k in range(4)], open_slot)

    def forward_step(data_iterator, stage):
        k, x = next(data_iterator)
        out = model(x) if k == 1 else router.route(k, model(x))  # micro-batch 1 skips its routing
        return out, lambda out: (out.pow(3).sum(), token_count(), {})

    run_micro_batches(forward_step, list(enumerate(inputs)), sync, phase=PhaseTimer().phase, phases={})
    with pytest.raises(RoutingError) as error:
        router.finish()
    message = str(error.value)
    assert "3 routed backwards for the call's 4 micro-batches" in message
    assert "(1, ('pg', 0, 1, 0))" in message  # the micro-batch and its key
    assert "outside any routed backward (before the backward of micro-batch 2" in message  # where it went instead


def test_a_backward_never_run_is_a_count_error():
    model, inputs, sync = _setup(2, seed=5)
    open_slot, _ = _slots(sync)
    router = GradientRouter(sync, ["a", "b"], open_slot)
    losses = [router.route(k, model(x)).sum() for k, x in enumerate(inputs)]
    losses[0].backward()
    with pytest.raises(RoutingError, match=r"1 routed backwards for the call's 2 micro-batches.*\(1, 'b'\)"):
        router.finish()


def test_reweight_raises_for_a_sample_without_provisional_gradient(monkeypatch):
    """A sample whose backward never reached its provisional gradient: the correction names it instead of reducing
    the group without it."""
    from leangrpo_mcore.schedules.reweight import ReweightSchedule

    real = ReweightSchedule._backward_into

    def skipping(self, store, key, loss, retain_graph):
        if store is self._partial and key == (1, 2, 0):
            return
        real(self, store, key, loss, retain_graph)

    monkeypatch.setattr(ReweightSchedule, "_backward_into", skipping)
    with pytest.raises(RoutingError, match=r"\(1, 2, 0\) has no provisional gradient"):
        run_case(Case(schedule="reweight", group_size=4, prompts=2, num_steps=3))
