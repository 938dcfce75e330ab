"""Tensor-parallel-aware LoRA adapters on the backend linears.

An adapted linear (any module with ``parallel_mode`` built by a backend provider) gets two child
modules ``lora_A`` (weight (r, in)) and ``lora_B`` (weight (out, r)), so parameter names read like
PEFT's: ``transformer_blocks.0.attn.to_q.lora_A.weight``. The output is ``base(x) + s * B(A(x))`` with
``s = alpha / rank``. Sharding follows the base layer:

- column-parallel base (output sharded): A replicated, B sharded on its output rows. ``A(x)`` is
  computed identically on every rank and enters ``copy_to_tp`` so that A's gradient sums the
  contributions of every output shard;
- row-parallel base (input sharded): A sharded on its input columns, its partial output all-reduced
  over TP (the result is then replicated), B replicated;
- replicated base: both replicated.

A fused projection (one GEMM for q, k and v, output interleaved per head: see ``docs/models.md``) keeps one
adapter per projection, as PEFT has on diffusers' separate linears: each projection is a :class:`LoRASlot`
registered under diffusers' name (``attn.to_q``), with its own ``lora_A`` / ``lora_B`` and no base weight. The
fused linear adds every slot's term at that slot's rows. A target naming the fused linear adapts all its slots.

B starts at zero, so an adapted model equals its base at initialisation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from leangrpo_mcore.models.common.init import constant_init, init_parameter, set_init, uniform_fan_in
from leangrpo_mcore.models.common.tp import all_reduce_tp, copy_to_tp, divide, mark_tp_partitioned, tp_world_size


@dataclass
class LoRAConfig:
    """Which linears get adapters and their size."""

    rank: int = 32
    """Inner dimension r of each adapter."""
    alpha: float = 64.0
    """Scale numerator: the adapter output is multiplied by alpha / rank."""
    targets: tuple[str, ...] = field(default_factory=tuple)
    """Module-name suffixes (dotted boundaries). A match on a linear adapts it; a match on a container
    (e.g. ``ff``) adapts every backend linear inside it."""

    def to_dict(self) -> dict:
        """JSON-ready form (checkpoint metadata)."""
        return {"rank": int(self.rank), "alpha": float(self.alpha), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: dict) -> "LoRAConfig":
        """Inverse of :meth:`to_dict`."""
        return cls(rank=int(data["rank"]), alpha=float(data["alpha"]), targets=tuple(data["targets"]))


class LoRAFactor(torch.nn.Module):
    """One low-rank factor: a bare ``weight`` parameter (named like PEFT's lora_A / lora_B)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))


class AdapterHostMixin:
    """Mixed into every backend linear: adds the (optional) LoRA path to the base output."""

    lora_enabled: bool = True
    lora_merged: bool = False
    lora_scaling: float = 1.0
    lora_slots: tuple = ()
    """The :class:`LoRASlot` of each projection when this linear fuses several (see :func:`fuse_slots`)."""

    def has_lora(self) -> bool:
        """Whether adapters are attached to this linear."""
        return "lora_A" in self._modules

    def _adapter_active(self) -> bool:
        return self.has_lora() and self.lora_enabled and not self.lora_merged

    def add_adapter_output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the adapters' contribution when attached, enabled and not merged."""
        if self.lora_slots:
            return _add_slot_outputs(self.lora_slots, x, out)
        if not self._adapter_active():
            return out
        return out + lora_delta(self, x).to(out.dtype)


class LoRASlot(torch.nn.Module, AdapterHostMixin):
    """The LoRA host of one projection inside a fused linear: adapters only, the base weight is the fused one's.

    Output features of the fused linear are ordered (head, projection, unit): this slot's rows are
    ``[h, index, :]`` for every head ``h``, and its adapter's B is sharded over TP like any column-parallel B.
    """

    def __init__(self, fused: torch.nn.Module, index: int, parts: int, unit: int) -> None:
        super().__init__()
        # A plain attribute, not a child module: the fused linear is registered once, under its own name.
        object.__setattr__(self, "fused", fused)
        self.index, self.parts, self.unit = index, parts, unit
        self.parallel_mode = fused.parallel_mode
        self.full_in_features = fused.full_in_features
        self.full_out_features = divide(fused.full_out_features, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Slots are evaluated by their fused linear."""
        raise RuntimeError("a LoRA slot has no forward of its own; call the fused linear")

    def weight_rows(self) -> torch.Tensor:
        """This projection's rows of the local fused weight, as a (heads_local, unit, in) view."""
        weight = self.fused.weight
        return weight.view(-1, self.parts, self.unit, weight.shape[-1])[:, self.index]


def fuse_slots(fused: torch.nn.Module, unit: int, count: int) -> list[LoRASlot]:
    """Declare ``fused`` (output (heads, count, unit) per head) as ``count`` projections; returns their slots.

    The caller registers each slot under the name of the projection it stands for.
    """
    slots = [LoRASlot(fused, i, count, unit) for i in range(count)]
    fused.lora_slots = tuple(slots)
    return slots


def _add_slot_outputs(slots: tuple, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    active = [slot._adapter_active() for slot in slots]
    if not any(active):
        return out
    parts, unit = len(slots), slots[0].unit
    heads = out.shape[-1] // (parts * unit)
    deltas = [lora_delta(slot, x).unflatten(-1, (heads, unit)) if on else None for slot, on in zip(slots, active)]
    like = next(d for d in deltas if d is not None)
    zeros = like.new_zeros(()).expand_as(like)
    stacked = torch.stack([zeros if d is None else d for d in deltas], dim=-2)  # (..., heads, parts, unit)
    return out + stacked.flatten(-3).to(out.dtype)


def lora_delta(host: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter term ``s * B(A(x))`` of ``host`` for input ``x`` (see module doc for TP)."""
    a, b = host.lora_A.weight, host.lora_B.weight
    x = x.to(a.dtype)
    if host.parallel_mode == "column":
        hidden = copy_to_tp(F.linear(x, a))
    elif host.parallel_mode == "row":
        hidden = all_reduce_tp(F.linear(x, a))
    else:
        hidden = F.linear(x, a)
    return F.linear(hidden, b) * host.lora_scaling


def iter_lora_hosts(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every linear with adapters attached."""
    for name, module in model.named_modules():
        if isinstance(module, AdapterHostMixin) and module.has_lora():
            yield name, module


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _attach(host: torch.nn.Module, rank: int, alpha: float) -> None:
    weight = host.fused.weight if isinstance(host, LoRASlot) else host.weight
    full_in, full_out = host.full_in_features, host.full_out_features
    tp = tp_world_size()
    if host.parallel_mode == "row":
        a_cols, b_rows = divide(full_in, tp), full_out
    elif host.parallel_mode == "column":
        a_cols, b_rows = full_in, divide(full_out, tp)
    else:
        a_cols, b_rows = full_in, full_out
    host.lora_A = LoRAFactor(rank, a_cols, weight.dtype, weight.device)
    host.lora_B = LoRAFactor(b_rows, rank, weight.dtype, weight.device)
    if host.parallel_mode == "row":
        mark_tp_partitioned(host.lora_A.weight, 1)
    elif host.parallel_mode == "column":
        mark_tp_partitioned(host.lora_B.weight, 0)
    set_init(host.lora_A.weight, uniform_fan_in(full_in))
    set_init(host.lora_B.weight, constant_init(0.0))
    host.lora_scaling = float(alpha) / float(rank)
    host.lora_enabled = True
    host.lora_merged = False


def _slot_names(modules: dict[str, torch.nn.Module], fused: torch.nn.Module) -> dict[str, LoRASlot]:
    return {name: module for name, module in modules.items()
            if isinstance(module, LoRASlot) and module.fused is fused}


@torch.no_grad()
def apply_lora(model: torch.nn.Module, config: LoRAConfig, *, seed: int = 0,
               require_match: bool = True) -> list[str]:
    """Attach adapters to the linears selected by ``config.targets``; return the adapted names.

    A is drawn TP-invariantly from ``seed`` (same values at every TP size), B is zero. The config is
    recorded on ``model.lora_config`` (saved in checkpoints). ``require_match=False`` lets a target match
    nothing: a pipeline stage may hold none of its modules (single-stream blocks have no ``add_q_proj``).
    """
    if config.rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {config.rank}")
    if not config.targets:
        raise ValueError("LoRA needs at least one target module name")
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("this model already has LoRA adapters")
    modules = dict(model.named_modules())
    selected: dict[str, torch.nn.Module] = {}
    for target in config.targets:
        hits = [n for n in modules if n and _matches(n, target)]
        if not hits and require_match:
            raise ValueError(f"LoRA target {target!r} matches no module of {type(model).__name__}")
        for hit in hits:
            root = modules[hit]
            for sub_name, sub in root.named_modules(prefix=hit):
                if isinstance(sub, AdapterHostMixin) and not sub.lora_slots:
                    selected[sub_name] = sub
                elif getattr(sub, "lora_slots", ()):  # a fused linear: adapt each of its projections
                    selected.update(_slot_names(modules, sub))
    for name in sorted(selected):
        host = selected[name]
        _attach(host, config.rank, config.alpha)
        # Seeded per parameter name, so A does not depend on which other modules were targeted.
        init_parameter(host.lora_A.weight, f"{name}.lora_A.weight", seed)
        init_parameter(host.lora_B.weight, f"{name}.lora_B.weight", seed)
    model.lora_config = config
    return sorted(selected)


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """All adapter parameters (A and B of every adapted linear)."""
    params = []
    for _, host in iter_lora_hosts(model):
        params.extend([host.lora_A.weight, host.lora_B.weight])
    return params


def mark_only_lora_trainable(model: torch.nn.Module) -> int:
    """Freeze everything except the adapters; return the number of trainable parameters."""
    if getattr(model, "lora_config", None) is None:
        raise ValueError("the model has no LoRA adapters (call apply_lora first)")
    for param in model.parameters():
        param.requires_grad_(False)
    trainable = lora_parameters(model)
    for param in trainable:
        param.requires_grad_(True)
    return sum(p.numel() for p in trainable)


def _delta_weight(host: torch.nn.Module) -> torch.Tensor:
    # The local shards compose without communication: column W_l += B_l A; row W_l += B A_l.
    return (host.lora_B.weight.float() @ host.lora_A.weight.float()) * host.lora_scaling


def _fold(host: torch.nn.Module, sign: float) -> None:
    weight = host.weight_rows() if isinstance(host, LoRASlot) else host.weight
    delta = _delta_weight(host).view(weight.shape)
    weight.copy_((weight.float() + sign * delta).to(weight.dtype))


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> int:
    """Fold ``s * B A`` into each base weight (fp32 math); return how many linears were merged."""
    count = 0
    for _, host in iter_lora_hosts(model):
        if not host.lora_merged:
            _fold(host, 1.0)
            host.lora_merged = True
            count += 1
    return count


@torch.no_grad()
def unmerge_lora(model: torch.nn.Module) -> int:
    """Undo :func:`merge_lora` (subtracts the same fp32 delta); return how many were unmerged."""
    count = 0
    for _, host in iter_lora_hosts(model):
        if host.lora_merged:
            _fold(host, -1.0)
            host.lora_merged = False
            count += 1
    return count


def lora_is_merged(model: torch.nn.Module) -> bool:
    """True when any adapter is currently merged into its base weight."""
    return any(host.lora_merged for _, host in iter_lora_hosts(model))


@contextlib.contextmanager
def disable_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the base model (adapters bypassed) inside the block, e.g. for a KL reference forward."""
    hosts = [host for _, host in iter_lora_hosts(model)]
    if any(host.lora_merged for host in hosts):
        raise ValueError("disable_adapters needs unmerged adapters (call unmerge_lora first)")
    previous = [host.lora_enabled for host in hosts]
    for host in hosts:
        host.lora_enabled = False
    try:
        yield model
    finally:
        for host, state in zip(hosts, previous):
            host.lora_enabled = state
