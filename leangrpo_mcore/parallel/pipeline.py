"""Micro-batches run by megatron-core's pipeline scheduler (``get_forward_backward_func``), at pipeline size 1.

A schedule hands :func:`run_micro_batches` a ``forward_step_func(data_iterator, model) -> (output, loss_func)``
and its micro-batches; megatron's ``forward_backward_no_pipelining`` runs forward, loss and backward of each
in turn. What megatron reads from the model's config is built here, once per call (:func:`schedule_config`):

- **loss scaling.** The unit losses are already normalised by the update's one weight
  (``schedules.base.loss_weight``: over every sample and selected step of all ranks), so the scheduler must not
  divide again. ``loss_func`` returns megatron's triple ``(loss, num_tokens, reduced)`` and the config sets
  ``calculate_per_token_loss``: megatron then backpropagates the loss exactly as returned (neither
  ``/ num_microbatches`` nor ``× cp_size`` is applied), so the gradients equal a plain ``loss.backward()``
  bit for bit. ``grad_scale_func`` is None (no loss scaling: bf16/fp32 training).
- **gradient sync.** :class:`~leangrpo_mcore.parallel.grad_sync.GradSync` keeps its meaning: ``per_backward``
  reduce-scatters on every backward like the baselines, ``coalesced`` holds every backward local until
  ``GradSync.finish``. Megatron's own rule (no sync for micro-batches 0..N−2, sync on the last) fits neither:
  one call here is one group's share of an update, not the update. So :meth:`GradSync.backward_mode` is both
  ``no_sync_func`` and the context around the whole call, and ``finalize_model_grads_func`` is None: the
  update finishes in ``Schedule.finish_update``. ``grad_sync_func`` is read only by the pipelined schedules.
- **CPU.** ``forward_backward_no_pipelining`` allocates its token counter with ``device="cuda"``, and the
  point-to-point module of the pipeline stages (:mod:`leangrpo_mcore.parallel.stages`) its receive buffers on
  ``torch.cuda.current_device()``; on a machine without CUDA those calls run with the allocations redirected to
  the CPU (:func:`cpu_bridge`). Nothing else on these paths touches CUDA.
- **pipeline stages** (``parallel.pp`` > 1). All micro-batches of a call share one boundary shape, which the
  caller gives (``tensor_shape``, from the policy stage's ``boundary_shape``): megatron then allocates each receive
  buffer in that shape (``variable_seq_lengths`` off: no shape exchange before every transfer), and no transfer
  synchronises the device afterwards (``batch_p2p_sync`` off, as in :class:`~leangrpo_mcore.parallel.stages.StageLink`;
  the synchronisation only worked around an old NCCL bug). Without a ``tensor_shape`` the shapes travel with every
  transfer. megatron's 1F1B frees each sent output's data as soon as it is sent
  (``deallocate_pipeline_outputs``), and an exception in the last stage's forward or loss is held until the call
  is over, then raised on every stage (:class:`_PipelineGuard`): megatron's schedules cannot abort, and the
  earlier stages would otherwise wait for gradients until the process group's timeout.
- **phases.** megatron brackets each micro-batch's forward + loss (``forward-compute``) and its backward
  (``backward-compute``) with ``config.timers``; :class:`_PhaseTimers` turns those brackets into the
  project's phase hook, so the step's phase breakdown names exactly what the scheduler ran. They only time:
  where a micro-batch's gradient accumulates is decided by autograd hooks registered in its forward
  (:mod:`leangrpo_mcore.parallel.routing`).

The "model" megatron sees is :class:`_Stage`: the config plus the two attributes the scheduler asks for. The
policy itself is reached through the schedule's velocity function inside ``forward_step_func``.
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from leangrpo_mcore.mcore_import import import_megatron_core

import_megatron_core()  # megatron-core's first import, without torch's compiler and wandb (see mcore_import)

from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from leangrpo_mcore.parallel.grad_sync import GradSync, PhaseFn

ForwardStepFunc = Callable[[Iterator, Any], tuple[torch.Tensor, Callable]]
"""``forward_step_func(data_iterator, model) -> (output, loss_func)`` in megatron's convention."""


@dataclass
class ScheduleConfig(ModelParallelConfig):
    """megatron's ``ModelParallelConfig`` plus the two ``TransformerConfig`` fields the PP=1 schedule reads."""

    calculate_per_token_loss: bool = True
    """Backpropagate ``loss_func``'s loss as returned (the unit losses carry the update's weight already)."""
    hidden_size: int = 0
    """The 1F1B schedules' nominal boundary width; unused: the boundary shape is the call's ``tensor_shape``
    (``adjust_tensor_shapes_fn``), or exchanged before each transfer (``variable_seq_lengths``)."""
    fine_grained_activation_offloading: bool = False
    """Megatron's activation offloading (unused here)."""


class _Stage:
    """What megatron's scheduler reads from a model: its config, its type, ``set_input_tensor``."""

    model_type = ModelType.encoder_or_decoder

    def __init__(self, config: ScheduleConfig, policy: Optional[torch.nn.Module] = None,
                 input_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.config, self.policy, self.input_hook = config, policy, input_hook

    def set_input_tensor(self, input_tensor) -> None:
        """Hand the received boundary (through ``input_hook`` when given) to the policy stage (pipeline size
        > 1); the first stage takes its inputs from the data iterator."""
        if self.policy is not None and not self.policy.stage.pre_process:
            if self.input_hook is not None:
                input_tensor = [self.input_hook(t) for t in input_tensor] if isinstance(input_tensor, list) \
                    else self.input_hook(input_tensor)
            self.policy.set_input_tensor(input_tensor)


class _GroupSize:
    """A process-group stand-in answering ``size()`` (megatron passes the CP size to its loss scaling)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _PhaseTimers:
    """megatron's ``timers(name, log_level)`` interface over the project's ``phase`` hook (timing only)."""

    def __init__(self, phase: PhaseFn, names: dict[str, str]) -> None:
        self.phase, self.names = phase, names
        self._open: dict[str, contextlib.ExitStack] = {}

    def __call__(self, name: str, log_level: Optional[int] = None) -> "_PhaseTimers._Timer":
        return _PhaseTimers._Timer(self, name)

    class _Timer:
        def __init__(self, owner: "_PhaseTimers", name: str) -> None:
            self.owner, self.name = owner, name

        def start(self, barrier: bool = False) -> None:
            owner, phase = self.owner, self.owner.names.get(self.name)
            if phase is None:
                return
            stack = contextlib.ExitStack()
            stack.enter_context(owner.phase(phase))
            owner._open[self.name] = stack

        def stop(self, barrier: bool = False) -> None:
            stack = self.owner._open.pop(self.name, None)
            if stack is not None:
                stack.close()


def schedule_config(grad_sync: Optional[GradSync], phase: PhaseFn, phases: dict[str, str],
                    dtype: torch.dtype = torch.float32, pipelined: bool = False,
                    variable_shapes: bool = True) -> ScheduleConfig:
    """The config megatron's scheduler reads: ``grad_sync``'s mode as ``no_sync_func``, ``phase`` as timers.
    ``pipelined`` (stages of ``parallel.pp`` > 1): megatron's 1F1B frees each sent output's data at once
    (``deallocate_pipeline_outputs``, see :class:`_PipelineGuard`); ``variable_shapes``: each transfer exchanges
    its shape first (off when the call's one boundary shape is known: module doc). No transfer synchronises the
    device after it (``batch_p2p_sync``)."""
    return ScheduleConfig(pipeline_dtype=dtype, variable_seq_lengths=variable_shapes, batch_p2p_sync=False,
                          deallocate_pipeline_outputs=pipelined,
                          no_sync_func=grad_sync.backward_mode if grad_sync is not None else None,
                          grad_sync_func=None,
                          finalize_model_grads_func=None, grad_scale_func=None,
                          timers=_PhaseTimers(phase, phases), barrier_with_L1_time=False)


def _process_groups(cp_size: int, pp_group=None) -> ProcessGroupCollection:
    groups = ProcessGroupCollection()
    groups.tp, groups.cp, groups.embd, groups.pos_embd = None, _GroupSize(cp_size), None, None
    groups.pp, groups.dp_cp = pp_group, None
    return groups


class _CpuCuda:
    """``torch.cuda`` for megatron's pipeline modules on a machine without CUDA (see :func:`cpu_bridge`)."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` for megatron's pipeline modules without CUDA: ``device="cuda"`` and ``torch.cuda.current_device()``
    allocations land on the CPU, ``torch.cuda.synchronize()`` does nothing."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def cpu_bridge() -> Iterator[None]:
    """Without CUDA, megatron's scheduler (its token counter) and point-to-point module (its receive buffers and
    stream synchronisations) see :class:`_CpuTorch` for the duration; with CUDA nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    saved = schedules.torch, p2p_communication.torch
    schedules.torch = p2p_communication.torch = _CpuTorch()
    try:
        yield
    finally:
        schedules.torch, p2p_communication.torch = saved


def token_count() -> torch.Tensor:
    """The ``num_tokens`` entry of ``loss_func``'s triple: one, on the device of the scheduler's counter."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return torch.ones((), dtype=torch.int, device=device)


def loss_triple(loss: torch.Tensor):
    """megatron's ``(loss, num_tokens, reduced)`` of a ``loss_func``, the loss backpropagated as it is (the unit
    losses carry the update's weight already: module doc)."""
    return loss, token_count(), {"loss": loss.detach()}


InputHook = Callable[[torch.Tensor], torch.Tensor]
"""A map of each boundary the scheduler hands a stage, before the policy sees it."""


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy when it is a view: megatron frees a sent output's data in place
    (``deallocate_output_tensor``), which it refuses for a view of another tensor. The policies' boundaries
    (a concatenation) and the schedules' losses (a sum) are never views; a view costs one copy."""
    return tensor if tensor._base is None else tensor.clone()


class _PipelineGuard:
    """One pipelined scheduler call's exceptions on the last stage, raised on every stage once the call is over.

    Megatron's schedules cannot abort: a last stage that raises in a forward or a loss would leave the earlier
    stages blocked in ``recv_backward`` (or the next collective) until the process group's timeout. So the last
    stage keeps its first exception and answers that micro-batch and every later one with a zero loss on the
    boundary it received, without running them: the earlier stages receive zero gradients of the right shape
    and the schedule runs to its end in moments. Then the last stage broadcasts over the pipeline group whether
    it failed (one int: the call's only extra collective), and on failure the exception's class and message:
    every stage raises the same exception, so every rank prints the same ``error:`` line (a
    :class:`~leangrpo_mcore.errors.UserError`) or the same last traceback line (a bug)."""

    def __init__(self, ctx, pp: int, forward_only: bool) -> None:
        self.group, self.forward_only = ctx.pp_group, forward_only
        self.last = ctx.pp_rank == pp - 1
        self.src = dist.get_global_rank(self.group, pp - 1)
        self.error: Optional[Exception] = None
        """The last stage's first exception in this call."""
        self._received: Optional[torch.Tensor] = None

    def recording(self, hook: Optional[InputHook]) -> InputHook:
        """``hook`` (an input hook of :class:`_Stage`, or None) that also remembers each received boundary."""
        def record(tensor: torch.Tensor) -> torch.Tensor:
            self._received = tensor
            return tensor if hook is None else hook(tensor)
        return record

    def _failed(self, error: Exception):
        """Keep the first ``error``; the zero-loss stand-in of the micro-batch (megatron's forward step output)."""
        if self.error is None:
            self.error = error
        zero = self._received.sum() * 0.0
        return zero, (None if self.forward_only else loss_triple)

    def forward_step(self, inner: ForwardStepFunc) -> ForwardStepFunc:
        """``inner`` whose sent boundaries and losses are never views (:func:`_owned`); on the last stage one that
        keeps an exception instead of raising it (class doc)."""
        def guarded(data_iterator, model):
            if self.error is not None:
                next(data_iterator)
                return self._failed(self.error)
            try:
                output, loss_func = inner(data_iterator, model)
            except Exception as error:  # noqa: BLE001 - re-raised on every stage after the call
                if not self.last:
                    raise
                return self._failed(error)
            if not (self.last or self.forward_only):
                output = _owned(output)  # the boundary megatron frees once sent
            return output, (None if loss_func is None else self._loss(loss_func))
        return guarded

    def _loss(self, loss_func: Callable) -> Callable:
        def guarded(output: torch.Tensor):
            try:
                loss, *rest = loss_func(output)
            except Exception as error:  # noqa: BLE001 - re-raised on every stage after the call
                return loss_triple(self._failed(error)[0])
            return (_owned(loss), *rest)
        return guarded

    def raise_if_failed(self) -> None:
        """Raise the last stage's exception on every stage of the pipeline, if it had one (class doc)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        failed = torch.tensor([int(self.error is not None)], dtype=torch.int32, device=device)
        dist.broadcast(failed, src=self.src, group=self.group)
        if not int(failed.item()):
            return
        payload = [_described(self.error) if self.last else None]
        dist.broadcast_object_list(payload, src=self.src, group=self.group)
        if self.last:
            raise self.error
        raise _rebuilt(*payload[0]) from None


def _described(error: Exception) -> tuple[type, str]:
    """(class, message) of ``error`` for the other stages; RuntimeError when its class cannot travel."""
    try:
        pickle.dumps(type(error))
        return type(error), str(error)
    except Exception:  # noqa: BLE001 - a local class: its name travels in the message instead
        return RuntimeError, f"{type(error).__name__}: {error}"


def _rebuilt(kind: type, message: str) -> Exception:
    """``kind(message)``, or a RuntimeError naming ``kind`` when its constructor takes other arguments."""
    try:
        return kind(message)
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{kind.__name__}: {message}")


P2P_TIMERS = ("forward-recv", "backward-recv", "forward-send", "backward-send", "forward-send-backward-recv",
              "backward-send-forward-recv")
"""megatron's point-to-point timer names: at pipeline size > 1 they are the ``bubble`` phase (transfers and the
waits for the other stages)."""


def run_micro_batches(forward_step_func: ForwardStepFunc, micro_batches: Sequence, grad_sync: Optional[GradSync],
                      *, phase: PhaseFn, phases: dict[str, str], forward_only: bool = False,
                      dtype: torch.dtype = torch.float32, pipeline: Optional[torch.nn.Module] = None,
                      ctx=None, input_hook: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                      tensor_shape: Optional[tuple[int, ...]] = None) -> Optional[list]:
    """Run ``micro_batches`` (any objects ``forward_step_func`` draws from its iterator) through megatron's
    ``get_forward_backward_func()``; returns the scheduler's per-micro-batch ``reduced`` (the last stage's).

    ``phases`` maps megatron's timer names (``forward-compute``, ``backward-compute``) to phase names. With
    ``pipeline`` (this rank's policy stage, ``parallel.pp`` > 1) the call is megatron's 1F1B schedule over the
    pipeline group: every stage calls it with the same micro-batches, ``forward_step_func`` returns the boundary
    tensor on a stage other than the last, the boundaries and their gradients travel in ``dtype``, and the
    transfers are timed as the ``bubble`` phase. A ``forward_only`` call may go without ``grad_sync`` (then ``ctx``
    is the parallel context): nothing is backpropagated, so nothing is synchronised. ``input_hook`` maps each
    boundary the scheduler hands a stage before the policy sees it; ``tensor_shape`` is the boundary shape every
    micro-batch shares (None: exchanged before each transfer). Where each micro-batch's gradient accumulates
    is the caller's choice: a :class:`~leangrpo_mcore.parallel.routing.GradientRouter` hooked inside
    ``forward_step_func`` routes each backward to its own slot."""
    if not micro_batches:
        return []
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if grad_sync is None and not forward_only:
        raise ValueError("a scheduler call with backwards needs the gradient sync")
    ctx = grad_sync.ctx if grad_sync is not None else ctx
    pp = int(ctx.layout.pp) if pipeline is not None else 1
    if pp > 1:
        phases = {**phases, **{name: "bubble" for name in P2P_TIMERS}}
    config = schedule_config(grad_sync, phase, phases, dtype, pipelined=pp > 1, variable_shapes=tensor_shape is None)
    guard = _PipelineGuard(ctx, pp, forward_only) if pp > 1 else None
    if guard is not None:
        forward_step_func, input_hook = guard.forward_step(forward_step_func), guard.recording(input_hook)
    sync = grad_sync.backward_mode() if grad_sync is not None else contextlib.nullcontext()
    forward_backward = get_forward_backward_func(pp_size=pp, vp_size=None)
    stage = _Stage(config, pipeline, input_hook)
    extra = {}
    if pp > 1:
        extra["p2p_communicator"] = P2PCommunicator(pp_group=ctx.pp_group, config=config)
        if tensor_shape is not None:
            shapes = [tuple(tensor_shape)]
            extra["adjust_tensor_shapes_fn"] = lambda recv, send: (shapes, shapes)
    with cpu_bridge(), sync:
        out = forward_backward(forward_step_func=forward_step_func, data_iterator=iter(micro_batches),
                               model=stage, num_microbatches=len(micro_batches), seq_length=0,
                               micro_batch_size=1, forward_only=forward_only,
                               pg_collection=_process_groups(int(ctx.layout.cp), ctx.pp_group if pp > 1 else None),
                               **extra)
    if guard is not None:
        guard.raise_if_failed()
    return out
