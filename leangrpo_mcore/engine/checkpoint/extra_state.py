"""Modules' extra state (``nn.Module.get_extra_state``) in training checkpoints: Transformer Engine's FP8 metadata.

torch lets a module keep state that is neither a parameter nor a buffer through ``get_extra_state`` /
``set_extra_state``; ``state_dict()`` lists it as ``<module>._extra_state``. Transformer Engine's modules keep
their FP8 metadata there (the recipe, flags and, for delayed scaling, scales and amax histories, pickled into a
uint8 tensor). The training checkpoint walks parameters, not ``state_dict()``, so this module saves and restores
that state itself. The rules:

- A module *has* extra state when its ``get_extra_state()`` returns something other than None. megatron's
  local ``ColumnParallelLinear`` / ``RowParallelLinear`` return None (a placeholder for TE compatibility) and are
  skipped; a TE module returns a tensor (holding no FP8 metadata until FP8 has run) and is always saved.
- The DCP key is ``extra/<module>._extra_state/tp_<r>``: one entry per module and tensor-parallel rank, the
  value serialized with ``torch.save`` and stored as opaque bytes (never resharded; read back with
  ``weights_only=True``, so a state is tensors and plain containers; older TE's ``io.BytesIO`` travels as its
  bytes in a uint8 tensor). The data-parallel replicas
  of a TP rank hold the same key and DCP writes one of them: under the current-scaling recipes TE's state is the
  recipe and flags only, the same on every rank.
- On load at the TP degree of the save, each rank restores its own TP rank's entry: resume is exact. At another
  TP degree every rank restores TP rank 0's entry (no rank of the new layout corresponds to an old one); for TE
  under current scaling that is exact too, its state being the same on every rank.
- A checkpoint without an entry for a module that has extra state (written before extra state was saved, or by
  the local backend, then resumed under TE) still loads, with one warning naming the modules: they keep the
  state they were built with. That is exact for the current-scaling recipes this project offers (TE derives
  every scale from the tensor it quantises), which is why it is a warning and not an error. Entries for modules
  that have no extra state here are ignored with a warning too.
"""

from __future__ import annotations

import io
import re
from typing import Any, Callable, Optional

import torch

from leangrpo_mcore.errors import UserError

PREFIX = "extra/"
_KEY = re.compile(r"^extra/(?P<module>.*?)\.?_extra_state/tp_(?P<tp>\d+)$")


def _key(name: str, tp: int) -> str:
    return f"{PREFIX}{name + '.' if name else ''}_extra_state/tp_{tp}"


def _module_of(key: str) -> Optional[tuple[str, int]]:
    """(module name, TP rank) of an ``extra/`` key, or None for another key."""
    match = _KEY.match(key)
    if match is None:
        return None
    return match.group("module"), int(match.group("tp"))


def extra_states(model: torch.nn.Module) -> dict[str, Any]:
    """``{module name: its extra state}`` of every module whose ``get_extra_state()`` is not None."""
    found = {}
    for name, module in model.named_modules():
        if type(module).get_extra_state is torch.nn.Module.get_extra_state:
            continue
        state = module.get_extra_state()
        if state is not None:
            found[name] = state
    return found


_BYTES_IO = "io.BytesIO"


def serialize(state: Any) -> bytes:
    """One module's extra state as bytes (``torch.save``; TE's is a uint8 tensor)."""
    if isinstance(state, io.BytesIO):  # older TE releases: not loadable with weights_only, so carried as bytes
        state = {_BYTES_IO: torch.frombuffer(bytearray(state.getvalue()), dtype=torch.uint8)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(blob: bytes) -> Any:
    """Inverse of :func:`serialize` (tensors on the CPU)."""
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and list(state) == [_BYTES_IO]:
        return io.BytesIO(state[_BYTES_IO].numpy().tobytes())
    return state


def save_entries(model: torch.nn.Module, tp: int) -> dict[str, bytes]:
    """The DCP entries of this rank's extra states (``tp``: this rank's tensor-parallel rank)."""
    return {_key(name, tp): serialize(state) for name, state in extra_states(model).items()}


def stored_modules(keys: Any) -> dict[str, int]:
    """``{module name: number of TP ranks it was saved at}`` from the keys of a checkpoint's metadata."""
    counts: dict[str, int] = {}
    for key in keys:
        found = _module_of(key)
        if found is not None:
            counts[found[0]] = counts.get(found[0], 0) + 1
    return counts


def load_targets(path: str, model: torch.nn.Module, keys: Any, tp: int, tp_size: int,
                 warn: Callable[[str], Any]) -> dict[str, bytearray]:
    """``{DCP key: empty bytearray}`` to read this rank's extra states into (see the module's rules)."""
    stored = stored_modules(keys)
    wanted = list(extra_states(model))
    missing = [name for name in wanted if name not in stored]
    if missing:
        warn(f"checkpoint {path} has no extra state (FP8 metadata) for {len(missing)} module(s) that keep one "
             f"(e.g. '{missing[0]}'); they keep their initial state")
    unused = sorted(set(stored) - set(wanted))
    if unused:
        warn(f"checkpoint {path} holds extra state of {len(unused)} module(s) that have none here "
             f"(e.g. '{unused[0]}'); ignored")
    return {_key(name, tp if stored[name] == tp_size else 0): bytearray() for name in wanted if name in stored}


def restore(model: torch.nn.Module, loaded: dict[str, bytearray], path: str) -> None:
    """Hand each module the extra state read into ``loaded`` (the filled :func:`load_targets`)."""
    modules = dict(model.named_modules())
    for key, blob in loaded.items():
        name, _ = _module_of(key)
        try:
            state = deserialize(bytes(blob))
        except Exception as err:  # noqa: BLE001 -- a foreign or damaged entry, in one line
            lines = str(err).strip().splitlines()
            raise UserError(f"checkpoint {path}: cannot read the extra state of '{name}': "
                            f"{lines[0] if lines else type(err).__name__}") from None
        modules[name].set_extra_state(state)
