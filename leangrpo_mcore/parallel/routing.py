"""Gradient routing: each micro-batch's backward accumulates into a slot of its own, found by autograd.

Reweight at pipeline size > 1 (docs/algorithms.md §6) runs the trained samples of a denoising step as one
megatron 1F1B call, each sample's forward and immediate backward a micro-batch; on every stage the parameter
gradients of micro-batch k's backward must land in k's slot (the sample's provisional gradient, or the group's
KL accumulator). Which backward is micro-batch k's is decided by autograd, not by the schedule's order:

- **keyed at the forward.** :meth:`GradientRouter.route` registers a hook on micro-batch k's output on this
  stage (the boundary sent on, or the last stage's velocity): the tensor its backward starts from, through which
  every parameter gradient of the stage flows. Whenever the schedule runs that backward (1F1B's first-in,
  first-out order, an interleaved order, the combined-1F1B split), the hook fires first in it.
- **before**: the slot must be empty (a gradient found there came from a backward nobody routed: reported, and
  dropped so that the slot can be used), then k's gradient so far is installed (``open_slot``).
- **after**: a final callback of the autograd engine, queued by the hook, runs once the whole backward pass is
  over, after the callbacks its modules queued (FSDP2's root post-backward, which finishes the stage's
  accumulated gradients), and moves the slot's content back to k (closing ``open_slot``). A gradient computed
  outside that backward (a deferred weight-gradient step) finds the slot empty of routes and is reported.
- **checked after the call** (:meth:`GradientRouter.finish`): every micro-batch of the call routed exactly once,
  the slot empty, and with a pipeline group every stage routed micro-batch k to the same key. The stages
  exchange their findings first, so each one raises the same :class:`RoutingError` at the same point instead of
  leaving the others waiting in a transfer.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from leangrpo_mcore.parallel.grad_sync import GradSync


class RoutingError(RuntimeError):
    """A micro-batch's gradient did not reach its own slot, or a gradient reached none (the message names the
    micro-batch and its key); the update would otherwise be reduced with wrong or missing advantages."""


def _queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd engine's current backward pass ends (its final callbacks)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class GradientRouter:
    """Routes the backward of each micro-batch of one scheduler call into its own slot (module doc).

    ``keys[k]`` names micro-batch k's slot (several micro-batches may share one: their gradients add up there);
    ``open_slot(key)`` is a context entered around the backward: it installs the key's gradient in the local slot
    of ``sync`` and moves it out at its exit. ``group`` is the pipeline group whose stages must agree on the keys
    (None: this rank alone).
    """

    def __init__(self, sync: GradSync, keys: Sequence[Hashable], open_slot: Callable[[Hashable], ContextManager],
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.sync, self.keys, self.open_slot, self.group = sync, list(keys), open_slot, group
        self.forwarded: list[tuple[int, Hashable]] = []
        """(micro-batch, key) of each routed forward, in forward order."""
        self.routed: list[int] = []
        """Micro-batches whose backward was routed, in backward order."""
        self.problems: list[str] = []
        self._open: Optional[tuple[int, contextlib.ExitStack]] = None

    def route(self, k: int, output: torch.Tensor) -> torch.Tensor:
        """Hook micro-batch k's output on this stage (inside its forward) so that its backward is routed to
        ``keys[k]``; returns ``output`` itself."""
        self.forwarded.append((k, self.keys[k]))
        if not output.requires_grad:  # no parameter of this stage is in its graph: there is nothing to route
            self.routed.append(k)
            return output
        output.register_hook(lambda grad: self._enter(k, grad))
        return output

    def _enter(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        if self._open is not None:
            self.problems.append(f"the backward of micro-batch {k} began inside micro-batch {self._open[0]}'s")
            return grad
        self._drop_strays(f"before the backward of micro-batch {k} (key {self.keys[k]})")
        stack = contextlib.ExitStack()
        stack.enter_context(self.open_slot(self.keys[k]))
        self._open = (k, stack)
        # queued again from the first callback, so that it runs after the ones the backward's modules queued
        _queue_callback(lambda: _queue_callback(self._exit))
        return grad

    def _exit(self) -> None:
        k, stack = self._open
        self._open = None
        stack.close()
        self.routed.append(k)

    def _drop_strays(self, where: str) -> None:
        stray = self.sync.take_local()
        if any(g is not None for g in stray):
            self.problems.append(f"gradients reached the slot outside any routed backward ({where})")

    def finish(self) -> None:
        """After the scheduler call: check the routes (module doc) on every stage; RoutingError unless each of
        the call's micro-batches was routed exactly once, to the same key on every stage."""
        if self._open is not None:
            self.problems.append(f"the backward of micro-batch {self._open[0]} never finished")
        self._drop_strays("after the scheduler call")
        counts = [self.routed.count(k) for k in range(len(self.keys))]
        if counts != [1] * len(self.keys):
            missing = [(k, self.keys[k]) for k, n in enumerate(counts) if n != 1]
            self.problems.append(f"{len(self.routed)} routed backwards for the call's {len(self.keys)} micro-batches; "
                                 f"not routed exactly once (micro-batch, key): {missing}")
        problems = self._gathered() if self.group is not None else self.problems
        if problems:
            raise RoutingError("; ".join(problems))

    def _gathered(self) -> list[str]:
        """Every stage's problems, each named by its stage, and any key on which the stages disagree."""
        found: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, (self.forwarded, self.problems), group=self.group)
        problems = [f"stage {s}: {p}" for s, (_, mine) in enumerate(found) for p in mine]
        first = found[0][0]
        for s, (forwarded, _) in enumerate(found[1:], start=1):
            differ = [(a, b) for a, b in zip(first, forwarded) if a != b]
            if differ or len(forwarded) != len(first):
                (k, key), (k_s, key_s) = differ[0] if differ else ((len(first), None), (len(forwarded), None))
                problems.append(f"stage 0 routed micro-batch {k} to {key}, stage {s} micro-batch {k_s} to {key_s}")
        return problems
