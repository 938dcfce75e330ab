"""Measurement helpers of the benchmark: forward timing, a restorable training state, gradient capture.

- :class:`ForwardProbe` wraps a velocity function and times every policy forward, sorted by kind: a no-grad
  rollout forward, a grad-enabled rollout forward (Retain / Reweight selected steps), a grad-enabled
  recompute (Native, and every update after the first of a rollout), or a KL reference forward.
- :class:`TrainingSnapshot` saves the trainable weights, the optimizer state and the LR schedule, and puts
  them back in place (no allocation), so every measured step of every schedule starts from the same state.
- :class:`GradientCapture` copies the gradients the optimizer is about to apply (parity checks).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

FORWARD_KINDS = ("nograd", "rollout_grad", "recompute", "reference")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU), so wall-clock times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ForwardTally:
    """Seconds and sample-forwards (rows) per forward kind during one step."""

    seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in FORWARD_KINDS})
    rows: dict[str, int] = field(default_factory=lambda: {k: 0 for k in FORWARD_KINDS})


class ForwardProbe:
    """A velocity function that times the wrapped one; one probe serves every engine of a benchmark.

    A grad-enabled forward is a *rollout* forward while the step's schedule is recompute-free and no
    optimizer step has happened yet in this step (the engine rolls out every update block before the first
    optimizer step); any other grad-enabled forward is a recompute. Call :meth:`begin_step` before each
    step and register :meth:`after_optimizer_step` as the optimizer's post-step hook.
    """

    def __init__(self, velocity_fn: Any, device: torch.device) -> None:
        self.inner = velocity_fn
        self.device = torch.device(device)
        self.tally = ForwardTally()
        self._recompute_free = False
        self._updated = False
        self._reference_depth = 0

    def begin_step(self, recompute_free: bool) -> None:
        """Start counting a step of a schedule that does (not) train from its rollout forwards."""
        self.tally = ForwardTally()
        self._recompute_free = bool(recompute_free)
        self._updated = False

    def after_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Optimizer post-step hook: later grad-enabled forwards of this step are recomputes."""
        self._updated = True

    def _kind(self) -> str:
        if self._reference_depth:
            return "reference"
        if not torch.is_grad_enabled():
            return "nograd"
        return "rollout_grad" if self._recompute_free and not self._updated else "recompute"

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, conditioning: Any) -> torch.Tensor:
        """The wrapped velocity, timed (the device is synchronised around the call)."""
        kind = self._kind()
        link = getattr(self.inner, "link", None)  # pipeline stages: the waits for other stages are the bubble
        waited = link.waited if link is not None else 0.0
        synchronize(self.device)
        start = time.perf_counter()
        out = self.inner(latents, sigma, conditioning)
        synchronize(self.device)
        waited = (link.waited - waited) if link is not None else 0.0
        self.tally.seconds[kind] += time.perf_counter() - start - waited
        self.tally.rows[kind] += int(latents.shape[0])
        return out

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The wrapped function's reference context (forwards inside it count as ``reference``)."""
        with self.inner.reference():
            self._reference_depth += 1
            try:
                yield
            finally:
                self._reference_depth -= 1

    def _timed_velocities(self, requests: list) -> list:
        """The wrapped function's several forwards at once (pipeline stages), timed as one."""
        link = self.inner.link
        kind, waited = self._kind(), link.waited
        synchronize(self.device)
        start = time.perf_counter()
        out = self.inner.velocities(requests)
        synchronize(self.device)
        self.tally.seconds[kind] += time.perf_counter() - start - (link.waited - waited)
        self.tally.rows[kind] += sum(int(latents.shape[0]) for latents, _, _ in requests)
        return out

    def _timed_trained(self, requests: list, units: list[int], loss_of, route, grad_sync, *, phases,
                       forward_context) -> list:
        """The wrapped function's forwards with immediate backwards (pipeline stages): each forward timed where the
        schedule enters its forward context (its transfers and backward are the schedule's)."""

        @contextlib.contextmanager
        def timed(grad: bool) -> Iterator[None]:
            kind = self._kind()
            synchronize(self.device)
            start = time.perf_counter()
            with forward_context(grad):
                yield
            synchronize(self.device)
            self.tally.seconds[kind] += time.perf_counter() - start
            self.tally.rows[kind] += 1

        return self.inner.trained(requests, units, loss_of, route, grad_sync, phases=phases,
                                  forward_context=timed)

    def __getattr__(self, name: str) -> Any:
        if name in ("velocities", "trained"):  # only where the wrapped function has them (pipeline stages)
            getattr(self.inner, name)
            return self._timed_velocities if name == "velocities" else self._timed_trained
        return getattr(self.inner, name)


def _clone_state(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


class TrainingSnapshot:
    """Trainable weights + optimizer state + LR schedule, restored in place before every measured step."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 lr_scheduler: Optional[Any] = None) -> None:
        self.params, self.optimizer, self.lr_scheduler = params, optimizer, lr_scheduler
        self._weights = [local_tensor(p.detach()).clone() for p in params]
        self._state = {id(p): {k: _clone_state(v) for k, v in optimizer.state[p].items()}
                       for p in params if p in optimizer.state}
        self._lrs = [group["lr"] for group in optimizer.param_groups]
        self._scheduler = None if lr_scheduler is None else copy.deepcopy(lr_scheduler.state_dict())

    @classmethod
    def primed(cls, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               lr_scheduler: Optional[Any] = None) -> "TrainingSnapshot":
        """Snapshot after creating the optimizer's state with one zero-gradient step (weights unchanged).

        Measured steps then run the optimizer on existing state, as in the steady state of training,
        instead of timing its lazy state allocation.
        """
        before = cls(params, optimizer, lr_scheduler)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p in params:
            p.grad = None
        before.restore(weights_only=True)
        from leangrpo_mcore.models.backends import weights_changed

        weights_changed()  # restored weights: cached FP8 copies are stale
        return cls(params, optimizer, lr_scheduler)

    def restore(self, weights_only: bool = False) -> None:
        """Put the saved weights (and optimizer state, LR schedule) back, in place; drop gradients."""
        with torch.no_grad():
            for p, saved in zip(self.params, self._weights):
                local_tensor(p.detach()).copy_(saved)
                p.grad = None
        if weights_only:
            return
        for p in self.params:
            saved = self._state.get(id(p))
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state[p]
            for key, value in saved.items():
                current = state.get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) \
                        and current.shape == value.shape:
                    local_tensor(current).copy_(local_tensor(value))
                else:
                    state[key] = _clone_state(value)
        for group, lr in zip(self.optimizer.param_groups, self._lrs):
            group["lr"] = lr
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(copy.deepcopy(self._scheduler))


class GradientCapture:
    """Copies the local gradient shards the optimizer is about to apply (enable around one step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.enabled = False
        self.grads: Optional[list[Optional[torch.Tensor]]] = None
        optimizer.register_step_pre_hook(self._capture)

    def _capture(self, *args: Any, **kwargs: Any) -> None:
        if self.enabled and self.grads is None:
            self.grads = [None if p.grad is None else local_tensor(p.grad.detach()).float().clone()
                          for p in self.params]

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Capture the first optimizer step inside the block into :attr:`grads`."""
        self.grads, self.enabled = None, True
        try:
            yield
        finally:
            self.enabled = False
