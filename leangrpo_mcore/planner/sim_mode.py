"""Running the real training step without its memory: large tensors fake, small ones real, every storage counted.

:class:`SimulationMode` is a dispatch mode for simulating one rank of a full-size run in one CPU process:

- Tensors of more than :data:`SMALL_NUMEL` elements are *fake* (``FakeTensorMode``: shape, dtype, device and
  strides, no data, no compute). The parameters are built fake, so everything computed from them (policy
  activations, gradients, FSDP2's all-gather and reduce-scatter buffers, optimizer state) is fake too.
- Small tensors stay real and are computed for real: sigmas, selection masks, seeds, rewards, advantages, group
  statistics. The step's control flow (which steps train, which samples a rank owns, advantage clamps) therefore
  runs on real values, exactly as in training.
- Reading a Python number out of a fake tensor (``float(loss)``, a ratio statistic, the gradient norm) cannot
  give the real value; it gives :data:`FAKE_FLOAT` (or 1 / True), and :attr:`SimulationMode.fake_reads` counts
  them, so a report can say how many values were made up (none of them decides memory).
- Every storage allocated under the mode, real or fake, is counted with its byte size from allocation until the
  storage dies (FSDP2's storage resizes included), under the *label* active when it was allocated. The highest
  live total is the peak; :meth:`MemoryLedger.at_peak` gives it by label, with storages later identified as
  parameters, gradients or optimizer state (:meth:`MemoryLedger.mark`) counted under those.

The facts this relies on (from torch's own memory estimators): a mode sees ops on DTensors before DTensor
desugars them, so it returns ``NotImplemented`` for those and sees the local ops instead; DTensor's sharding
propagation runs ops on fake tensors of its own fake mode, which are not allocations; ``UntypedStorage.resize_``
bypasses the dispatcher and has to be wrapped; the fake ``wait_tensor`` returns a new tensor where the real one
returns its input.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

SMALL_NUMEL = 1 << 20
"""Tensors up to this many elements are real (4 MiB in float32): latents, sigmas, masks, rewards."""
FAKE_FLOAT = 1.0
"""What reading a float out of a fake tensor gives."""

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_SCALAR = torch.ops.aten._local_scalar_dense.default
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._unsafe_index.Tensor}


STAGING_BACKENDS = ("nccl", "gloo")
"""Collective backends whose internal copies :class:`SimulationMode` knows: NCCL makes none; gloo flattens a
reduce-scatter's input and an all-gather's output into a buffer of its own while the collective runs (measured:
peak = input size and output size, allocated inside the op, which a dispatch mode does not see)."""


def _staging_bytes(func, args: tuple, backend: str) -> int:
    """Bytes a collective of ``backend`` allocates inside the op (see :data:`STAGING_BACKENDS`)."""
    if backend != "gloo" or func.namespace != "c10d":
        return 0
    name = func.__name__
    if "reduce_scatter" in name:
        which = args[1]
    elif "allgather" in name:
        which = args[0]
    else:
        return 0
    tensors = _tensors(which, [])
    return sum(t.numel() * t.element_size() for t in tensors)


def _real_mask_indices(args: tuple) -> tuple:
    """Indexing a fake tensor with a real boolean mask: the mask as the positions it selects (computed for real),
    so the result's shape is known (a fake mask's would depend on data)."""
    indices = list(args[1])
    for i, index in enumerate(indices):
        if isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and index.dtype == torch.bool:
            positions = index.nonzero(as_tuple=True)
            indices[i:i + 1] = list(positions)
    return (args[0], indices, *args[2:])


class MemoryLedger:
    """Live bytes of the counted storages, by label, and the state at the highest total of each *region*.

    A region is a stretch of the run named by the caller (a simulation names the rollout and the update apart):
    each region keeps its own peak and who was live then, so a peak can be scaled region by region.
    """

    def __init__(self) -> None:
        self._info = WeakIdKeyDictionary()  # storage -> [serial, nbytes, label]
        self._live: dict[int, list] = {}
        self._serial = 0
        self._marks: dict[int, str] = {}
        self.label = "other"
        """Label given to storages allocated now."""
        self.tag_grad = False
        """Add ``:grad`` to the label of storages allocated with grad mode on (the parameters' label excepted)."""
        self.region = "other"
        """Region whose peak the current level counts toward."""
        self.total = 0
        """Live bytes now."""
        self.peaks: dict[str, int] = {}
        """Highest live total per region."""
        self._snapshots: dict[str, dict[int, tuple[int, str]]] = {}
        self._stale: set[str] = set()

    @property
    def peak(self) -> int:
        """Highest live total so far, over every region."""
        return max(self.peaks.values(), default=self.total)

    def add(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` from now until it dies (once)."""
        if storage in self._info:
            return
        self._serial += 1
        label = self.label
        if self.tag_grad and label != "parameters" and torch.is_grad_enabled():
            label = f"{label}:grad"
        entry = [self._serial, storage.nbytes(), label]
        self._info[storage] = entry
        self._live[entry[0]] = entry
        weakref.finalize(storage, self._remove, entry[0])
        self._grow(entry[1])

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` changed size (FSDP2 frees and re-allocates unsharded parameters by resizing)."""
        entry = self._info.get(storage)
        if entry is None:
            return
        change = storage.nbytes() - entry[1]
        if change < 0:
            self._capture()
        entry[1] = storage.nbytes()
        self._grow(change)

    def transient(self, nbytes: int) -> None:
        """``nbytes`` allocated and freed again at once (an op's internal buffer)."""
        self._serial += 1
        entry = [self._serial, nbytes, self.label]
        self._live[entry[0]] = entry
        self._grow(nbytes)
        self._remove(entry[0])

    def _remove(self, serial: int) -> None:
        if serial in self._live:
            self._capture()  # the state at a peak, before this storage goes
        entry = self._live.pop(serial, None)
        if entry is not None:
            self._grow(-entry[1])

    def _grow(self, change: int) -> None:
        self.total += change
        if self.total > self.peaks.get(self.region, -1):
            self.peaks[self.region] = self.total
            self._stale.add(self.region)

    def _capture(self) -> None:
        """Remember who was live at a region's new peak (taken lazily: before the first free after it, or when
        the region changes)."""
        if not self._stale:
            return
        snapshot = {serial: (entry[1], entry[2]) for serial, entry in self._live.items()}
        for region in self._stale:
            self._snapshots[region] = snapshot
        self._stale.clear()

    def enter(self, region: str) -> None:
        """Count from now toward ``region``'s peak."""
        self._capture()
        self.region = region
        self.peaks.setdefault(region, self.total)
        if region not in self._snapshots:
            self._stale.add(region)

    def mark(self, tensors: Iterator[torch.Tensor], label: str) -> None:
        """Count the storages of ``tensors`` under ``label`` (parameters, gradients, optimizer state), at the
        peaks too when they were live then."""
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                tensor = tensor._local_tensor
            if not isinstance(tensor, torch.Tensor):
                continue
            entry = self._info.get(tensor.untyped_storage())
            if entry is not None:
                entry[2] = label
                self._marks[entry[0]] = label

    def reset_peak(self) -> None:
        """Forget every peak: start anew at the current level (e.g. at the start of the measured step)."""
        self.peaks, self._snapshots, self._stale = {}, {}, set()
        self.enter(self.region)

    def at_peak(self, region: Optional[str] = None) -> dict[str, int]:
        """Bytes by label at the highest total (of ``region``, or of all)."""
        self._capture()
        if region is None:
            region = max(self.peaks, key=self.peaks.get) if self.peaks else self.region
        out: dict[str, int] = defaultdict(int)
        for serial, (nbytes, label) in self._snapshots.get(region, {}).items():
            out[self._marks.get(serial, label)] += nbytes
        return dict(out)

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Allocations inside the block get ``label``."""
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before


def _tensors(tree: Any, out: list) -> list:
    """The tensors in nested tuples, lists and dicts (a fast tree flatten for op arguments)."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _tensors(item, out)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, out)
    return out


def _numel(outputs: Any) -> int:
    return max((t.numel() for t in _tensors(outputs, [])), default=0)


_TENSOR_ARGS: dict[Any, bool] = {}


def _has_tensor_args(func) -> bool:
    known = _TENSOR_ARGS.get(func)
    if known is None:
        known = _TENSOR_ARGS[func] = any("Tensor" in str(arg.type) for arg in func._schema.arguments)
    return known


class SimulationMode(TorchDispatchMode):
    """See the module docstring. ``with SimulationMode() as sim:`` … ``sim.ledger``, ``sim.fake_mode``."""

    def __init__(self, small_numel: int = SMALL_NUMEL, backend: str = "nccl") -> None:
        super().__init__()
        if backend not in STAGING_BACKENDS:
            raise ValueError(f"unknown collective backend {backend!r}; known: {', '.join(STAGING_BACKENDS)}")
        self.backend = backend
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.ledger = MemoryLedger()
        self.small_numel = small_numel
        self.fake_reads = 0
        """How many Python numbers were read out of fake tensors (made up)."""
        self._resize = None
        self._forced = 0

    def __enter__(self) -> "SimulationMode":
        original = torch.UntypedStorage.resize_
        ledger = self.ledger

        def resize_(storage, size):
            result = original(storage, size)
            ledger.resized(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def all_fake(self) -> Iterator[None]:
        """Inside the block every tensor made from nothing or from meta tensors is fake, whatever its size (the
        parameters, the optimizer state); ops on real tensors (a device mesh's rank table) stay real."""
        self._forced += 1
        try:
            yield
        finally:
            self._forced -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        staging = _staging_bytes(func, args, self.backend)
        if staging:
            with self.ledger.labelled("collective_staging"):
                self.ledger.transient(staging)
        tensors = _tensors((args, kwargs), [])
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        if fakes:
            if any(t.fake_mode is not self.fake_mode for t in fakes):
                return func(*args, **kwargs)  # DTensor's sharding propagation: metadata only, not memory
            if func is _SCALAR:
                self.fake_reads += 1
                dtype = fakes[0].dtype
                return True if dtype == torch.bool else (FAKE_FLOAT if dtype.is_floating_point else 1)
            if func is _WAIT:
                return args[0]
            if func in _INDEXING:
                args = _real_mask_indices(args)
            with self.fake_mode:
                out = func(*args, **kwargs)
        elif (self._forced and all(t.is_meta for t in tensors)) or self._creates_large(func, args, kwargs):
            with self.fake_mode:
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if _numel(out) > self.small_numel:
                out = self._to_fake(out)
        self._count(out)
        return out

    def _creates_large(self, func, args, kwargs) -> bool:
        """Whether an op without fake inputs would make a large tensor (factories: ask the fake mode)."""
        if _has_tensor_args(func) and not func.__name__.startswith("new_"):
            return False
        with self.fake_mode:
            probe = func(*args, **kwargs)
        return _numel(probe) > self.small_numel

    def _to_fake(self, out: Any) -> Any:
        leaves, spec = tree_flatten(out)
        converted = [self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                     and t.numel() > self.small_numel else t for t in leaves]
        return spec.unflatten(converted)

    def _count(self, out: Any) -> None:
        for t in _tensors(out, []):
            if not isinstance(t, DTensor):
                if isinstance(t, FakeTensor) and t.fake_mode is not self.fake_mode:
                    continue
                self.ledger.add(t.untyped_storage())


def is_fake(tensor: Optional[torch.Tensor]) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) carries no data."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return isinstance(tensor, FakeTensor)
