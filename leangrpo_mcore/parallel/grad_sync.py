"""Gradient synchronisation, injected into the schedules (megatron-core's ``no_sync_func`` /
``finalize_model_grads_func`` idea).

Two places hold gradients:

- the **local** slot, where a backward accumulates on this rank: ``param.grad`` of a plain module, or the
  *unsharded* gradient FSDP2 keeps while its gradient sync is disabled;
- the **reduced** gradient the optimizer reads: FSDP2's sharded DTensor ``param.grad`` (summed over the
  data-parallel ranks), or ``param.grad`` itself without data parallelism.

Modes of :class:`GradSync`:

- ``per_backward`` (the baselines): every backward reduce-scatters at once through FSDP2's own hooks;
- ``coalesced``: backwards accumulate locally (FSDP2 sync disabled) and :meth:`GradSync.finish` moves the
  local gradient out and reduces it with ONE flat reduce-scatter (+ one all-reduce over dp_replicate).

Reweight works on the local slot directly: :meth:`take_local` moves the accumulated gradient out (no copy),
:meth:`put_local` installs a buffer as the accumulation target (so a backward adds into it in place),
:meth:`swap_local` does both in one pass over the parameters (one sample's gradient out, the next one's in), and
:meth:`reduce_local` reduces any list of local gradients — e.g. Σ_i A_i·P_i formed *before* any
cross-sample reduction — into the reduced gradients.

The flat reduce-scatter lays each parameter out exactly as FSDP2 shards it: dim-0 chunks of
ceil(rows / world) rows, the last ones padded, rank r owning rows [r·c, (r+1)·c).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.parallel.fsdp import fsdp_modules, is_fsdp
from leangrpo_mcore.parallel.mesh import ParallelContext

SYNC_MODES = ("per_backward", "coalesced")

LocalGrads = list[Optional[torch.Tensor]]
"""One entry per trainable parameter (GradSync.params order); None where nothing accumulated."""

PhaseFn = Callable[[str], ContextManager]


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


def grads_add_(acc: LocalGrads | None, grads: LocalGrads, scale: float | None = None) -> LocalGrads:
    """``acc + scale · grads`` elementwise (in place where ``acc`` has a tensor; allocates otherwise)."""
    out = [None] * len(grads) if acc is None else acc
    for i, g in enumerate(grads):
        if g is None:
            continue
        if out[i] is None:
            out[i] = g.clone() if scale is None else g * scale
        elif scale is None:
            out[i].add_(g)
        else:
            out[i].add_(g, alpha=scale)
    return out


def grads_nbytes(grads: LocalGrads | None) -> int:
    """Bytes held by a list of local gradients."""
    return 0 if grads is None else sum(g.numel() * g.element_size() for g in grads if g is not None)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> None:
    single = getattr(dist, "reduce_scatter_single", None)
    if single is not None:
        single(output, input, group=group)
    else:
        dist.reduce_scatter_tensor(output, input, group=group)


class GradSync:
    """Gradient synchronisation of one policy (plain module or FSDP2 root) over data parallelism."""

    def __init__(self, model: torch.nn.Module, ctx: ParallelContext, *, mode: str = "coalesced",
                 phase: PhaseFn = _no_phase, dense: bool = False) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"unknown gradient sync mode {mode!r}; valid: {', '.join(SYNC_MODES)}")
        self.model, self.ctx, self.mode, self.phase = model, ctx, mode, phase
        self.dense = dense
        """The ranks' local gradients may cover different parameters (two experts: a rank whose samples ran one
        expert has no gradient of the other): every reduction covers every trainable parameter, zeros where this
        rank has none, and every rank reduces at least once per update."""
        self.fsdp = is_fsdp(model)
        if ctx.fsdp_shard_size * int(ctx.layout.dp_replicate) > 1 and not self.fsdp:
            raise ValueError("data and context parallelism need an FSDP2-wrapped policy (parallel.fsdp.apply_fsdp)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._fsdp_params = self._map_fsdp_params() if self.fsdp else None
        self._pending: LocalGrads | None = None
        self._sync_on: Optional[bool] = None
        self.num_reductions = 0
        """Flat reduce-scatters issued by :meth:`reduce_local` (FSDP2's own ones are not counted)."""

    def _map_fsdp_params(self) -> list:
        by_param = {}
        for module in fsdp_modules(self.model):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    by_param[id(fsdp_param.sharded_param)] = fsdp_param
        missing = [i for i, p in enumerate(self.params) if id(p) not in by_param]
        if missing:
            raise ValueError(f"{len(missing)} trainable parameters are not managed by FSDP2")
        return [by_param[id(p)] for p in self.params]

    # ------------------------------------------------------------------ backward
    def _set_sync(self, on: bool) -> None:
        """FSDP2's gradient sync on or off; set only when it changes (setting it walks every FSDP2 module), so
        everything here sets it through this method."""
        if self.fsdp and self._sync_on is not on:
            self.model.set_requires_gradient_sync(on)
            self._sync_on = on

    @contextlib.contextmanager
    def backward_mode(self) -> Iterator[None]:
        """Backwards inside synchronise as the mode says: FSDP2 reduce-scatters each one only in
        ``per_backward`` mode (megatron's ``no_sync_func`` slot; see ``parallel/pipeline.py``)."""
        self._set_sync(self.mode == "per_backward")
        yield

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """``loss.backward()``; FSDP2 reduce-scatters inside it only in ``per_backward`` mode."""
        self._set_sync(self.mode == "per_backward")
        loss.backward(retain_graph=retain_graph)

    def backward_local(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """``loss.backward()`` into the local slot only (never synchronised), whatever the mode."""
        self._set_sync(False)
        loss.backward(retain_graph=retain_graph)

    # ------------------------------------------------------------------ local slot
    def take_local(self) -> LocalGrads:
        """Move the locally accumulated (unsharded) gradients out of the slot, leaving it empty."""
        return self.swap_local(None)

    def swap_local(self, grads: LocalGrads | None) -> LocalGrads:
        """Move the slot's gradients out (:meth:`take_local`) and install ``grads`` as the next backward's
        accumulation target (:meth:`put_local`; None: leave the slot empty), in one pass over the parameters."""
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} trainable parameters")
        if not self.fsdp:
            out = [p.grad for p in self.params]
            for p, g in zip(self.params, grads or [None] * len(self.params)):
                p.grad = g
            return out
        out: LocalGrads = []
        for fp, g in zip(self._fsdp_params, grads or [None] * len(self._fsdp_params)):
            acc = fp.unsharded_accumulated_grad
            fp.unsharded_accumulated_grad = None
            raw = fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
            if raw is not None:
                fp._unsharded_param.grad = None
                acc = raw if acc is None else acc.add_(raw.to(acc.dtype))
            out.append(acc)
            if g is not None:
                self._install(fp, g)
        return out

    @staticmethod
    def _install(fp, g: torch.Tensor) -> None:
        """``g`` as the accumulation target of FSDP2 parameter ``fp`` (its slot empty)."""
        if fp.reduce_dtype is not None and g.dtype == fp.reduce_dtype and g.dtype != fp._unsharded_param.dtype:
            fp.unsharded_accumulated_grad = g
        else:
            fp._unsharded_param.grad = g

    def local_tensors(self) -> Iterator[torch.Tensor]:
        """The gradient tensors in the local slot now, left where they are."""
        if not self.fsdp:
            yield from (p.grad for p in self.params if p.grad is not None)
            return
        for fp in self._fsdp_params:
            raw = fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
            yield from (g for g in (fp.unsharded_accumulated_grad, raw) if g is not None)

    def put_local(self, grads: LocalGrads) -> None:
        """Install ``grads`` as the accumulation target of the next backward (the slot must be empty)."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} trainable parameters")
        if not self.fsdp:
            for p, g in zip(self.params, grads):
                if p.grad is not None:
                    raise RuntimeError("put_local on an occupied gradient slot")
                p.grad = g
            return
        for fp, g in zip(self._fsdp_params, grads):
            if g is None:
                continue
            if fp.unsharded_accumulated_grad is not None or fp._unsharded_param.grad is not None:
                raise RuntimeError("put_local on an occupied gradient slot")
            self._install(fp, g)

    # ------------------------------------------------------------------ reduction
    def reduce_local(self, grads: LocalGrads) -> None:
        """Sum ``grads`` over the data-parallel ranks into the reduced gradients (one flat collective)."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} trainable parameters")
        with self.phase("sync"):
            if self.fsdp:
                self._reduce_fsdp(grads)
            else:
                self._pending = grads_add_(self._pending, grads) if self._pending is not None else list(grads)

    def _reduce_fsdp(self, grads: LocalGrads) -> None:
        if self.dense:
            grads = [g if g is not None else self._zeros(fp, grads) for fp, g in zip(self._fsdp_params, grads)]
        entries = [(fp, g) for fp, g in zip(self._fsdp_params, grads) if g is not None]
        if not entries:
            return
        group, world = self.ctx.dp_shard_group(), self.ctx.fsdp_shard_size
        dtype = entries[0][1].dtype
        rows = [-(-g.shape[0] // world) for _, g in entries]
        widths = [r * (g[0].numel() if g.ndim > 1 else 1) for r, (_, g) in zip(rows, entries)]
        flat = torch.zeros(world, sum(widths), dtype=dtype, device=entries[0][1].device)
        offset = 0
        for (fp, g), r, width in zip(entries, rows, widths):
            for rank in range(world):
                piece = g[rank * r:(rank + 1) * r].reshape(-1)
                flat[rank, offset:offset + piece.numel()] = piece
            offset += width
        out = torch.empty(flat.shape[1], dtype=dtype, device=flat.device)
        _reduce_scatter(out, flat.view(-1), group)
        replicate = self.ctx.dp_replicate_group()
        if replicate is not None:
            dist.all_reduce(out, group=replicate)
        self.num_reductions += 1
        offset = 0
        for (fp, _), width in zip(entries, widths):
            size = fp.sharded_size
            local = out[offset:offset + size.numel()].view(size).to(fp.sharded_param.dtype)
            self._accumulate_sharded(fp, local)
            offset += width

    @staticmethod
    def _zeros(fp, grads: LocalGrads) -> torch.Tensor:
        """A zero local gradient of FSDP2 parameter ``fp``, in the dtype of the others (or the one a backward
        would leave: the reduce dtype, else the compute dtype)."""
        like = next((g for g in grads if g is not None), None)
        dtype = like.dtype if like is not None else (fp.reduce_dtype or fp.param_dtype or fp.sharded_param.dtype)
        return torch.zeros(fp.sharded_param.shape, dtype=dtype, device=fp.sharded_param.device)

    @staticmethod
    def _accumulate_sharded(fp, local: torch.Tensor) -> None:
        param = fp.sharded_param
        if param.grad is None:
            param.grad = fp.to_sharded_dtensor(local.clone())
        else:
            param.grad._local_tensor.add_(local)

    def finish(self) -> None:
        """Reduce whatever is still local (coalesced mode) and publish the reduced gradients."""
        local = self.take_local()
        if any(g is not None for g in local) or (self.dense and self.fsdp and self.mode == "coalesced"
                                                         and self.num_reductions == 0):
            self.reduce_local(local)
        if not self.fsdp and self._pending is not None:
            for p, g in zip(self.params, self._pending):
                p.grad = g
            self._pending = None
        self._set_sync(True)

    def reduced_grads(self) -> list[Optional[torch.Tensor]]:
        """The reduced gradients (sharded DTensors under FSDP2), in ``params`` order."""
        return [p.grad for p in self.params]
