"""Random initialisation that is identical at every layout, and costs each rank only what it holds.

Every parameter carries an init rule (``set_init``): a function of a key, the FULL (unsharded) shape and a box
of it (offsets and sizes) that returns that box of the full tensor. The values come from a counter-based
generator: element ``i`` of the full tensor (its row-major index) hashes to ``h = H(H(i + k1) ^ k2)``, with
``H`` Chris Wellons' 32-bit "triple32" integer hash (three xor-shift-multiply rounds) and ``(k1, k2)`` drawn
from ``(seed, parameter name)`` (BLAKE2b). The top 23 bits of ``h`` give ``p = (2j + 1) / 2^24`` in (0, 1),
which the rule maps to its distribution: ``(2p - 1) · bound`` for a uniform, the inverse normal CDF (Acklam's
rational approximation, relative error 1.2e-9, far below float32's) for a normal. A value thus depends on the
seed, the parameter's name and the element's place in the full tensor only: a rank computes exactly its boxes
(TP slice, FSDP2 shard, pipeline stage), TP=2 holds exactly the slices of the TP=1 model, and the
construction order of modules does not matter.

Bit-for-bit at every layout, not just close: the hash is int32 arithmetic that wraps modulo 2^32, and the
mapping uses only IEEE operations that round correctly wherever they run (+, -, ×, ÷, sqrt, and a logarithm
built from ``frexp`` and a polynomial), never ``log`` or ``cos``, whose vectorised and scalar code paths
differ in the last bit, so which element falls in a vector's tail cannot change a value.
``tests/unit/test_counter_init.py`` checks the hash against plain Python integers and the normal against the
standard library's inverse CDF.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import torch

from leangrpo_mcore.models.common.tp import full_shape, is_tp_partitioned, tp_rank

InitFn = Callable[[int, Sequence[int], Sequence[int], Sequence[int]], torch.Tensor]
"""``rule(key, full_shape, offsets, sizes)`` -> the float32 box of the FULL tensor at ``offsets`` of ``sizes``."""
_INIT_ATTR = "leangrpo_init"
_CHUNK = 1 << 18
"""Elements hashed per pass (a few MB of temporaries, whatever the box's size)."""
_MAX_ELEMENTS = 1 << 31
"""Elements of one parameter the int32 counter addresses."""


def _i32(value: int) -> int:
    """An unsigned 32-bit constant as the int32 with the same bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


_ROUNDS = ((17, _i32(0xED5AD4BB)), (11, _i32(0xAC4C1B51)), (15, _i32(0x31848BAB)))
_LAST_SHIFT = 14


def _xor_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # x ^ (x >>> bits): torch's >> on int32 is arithmetic, so mask off the copied sign bits.
    return x.bitwise_xor_((x >> bits).bitwise_and_((1 << (32 - bits)) - 1))


def triple32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' triple32 hash of each int32 (in place; a bijection of the 32-bit words)."""
    for shift, factor in _ROUNDS:
        x = _xor_shift_right(x, shift).mul_(factor)
    return _xor_shift_right(x, _LAST_SHIFT)


def counter_hash(indices: torch.Tensor, key: int) -> torch.Tensor:
    """int32 hash of each element index (int64, < 2^31) under the 64-bit ``key``."""
    x = indices.to(torch.int32).add_(_i32(key))
    return triple32(triple32(x).bitwise_xor_(_i32(key >> 32)))


def open_unit(h: torch.Tensor) -> torch.Tensor:
    """float32 ``p = (2j + 1) / 2^24`` in (0, 1), ``j`` the top 23 bits of each hash (exact in float32)."""
    return (h >> 9).bitwise_and_((1 << 23) - 1).to(torch.float32).mul_(2.0).add_(1.0).mul_(2.0**-24)


_A = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
      -3.066479806614716e01, 2.506628277459239e00)
_B = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
      -1.328068155288572e01, 1.0)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
      4.374664141464968e00, 2.938163982698783e00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00, 1.0)
_P_LOW = 0.02425
"""Acklam's approximation of the inverse normal CDF: a rational function of (p - 1/2)^2 in the centre, of
sqrt(-2 log p) in the tails below ``_P_LOW`` and above ``1 - _P_LOW``."""


def _horner(x: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    out = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out.mul_(x).add_(c)
    return out


def _log(p: torch.Tensor) -> torch.Tensor:
    """Natural log from IEEE operations: ``p = m · 2^e`` with m in [sqrt(1/2), sqrt(2)), then
    ``log m = 2 atanh(s)``, ``s = (m - 1) / (m + 1)``, |s| < 0.172, by its series to s^21 (float64 accuracy)."""
    mantissa, exponent = torch.frexp(p)
    low = mantissa < math.sqrt(0.5)
    mantissa = torch.where(low, mantissa * 2.0, mantissa)
    exponent = (exponent - low.to(exponent.dtype)).to(p.dtype)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    series = _horner(s * s, tuple(1.0 / k for k in range(21, 0, -2)))
    return series.mul_(s).mul_(2.0).add_(exponent * math.log(2.0))


def inverse_normal_cdf(p: torch.Tensor) -> torch.Tensor:
    """Φ⁻¹(p) for each p in (0, 1), in float32 (see ``_A``; evaluated in float64, whose rounding keeps the
    approximation's accuracy where the central polynomial's terms cancel)."""
    p = p.to(torch.float64)
    q = p - 0.5
    r = q * q
    out = _horner(r, _A).mul_(q).div_(_horner(r, _B))
    tail = (p < _P_LOW) | (p > 1.0 - _P_LOW)
    if bool(tail.any()):
        tp = p[tail]
        lower = tp < 0.5
        t = _log(torch.where(lower, tp, 1.0 - tp)).mul_(-2.0).sqrt_()
        value = _horner(t, _C).div_(_horner(t, _D))
        out[tail] = torch.where(lower, value, -value)
    return out.to(torch.float32)


def flat_indices(full: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """int64 row-major indices into the FULL tensor of shape ``full`` of the box at ``offsets`` of ``sizes``."""
    stride, strides = 1, []
    for extent in reversed(tuple(full)):
        strides.append(stride)
        stride *= int(extent)
    strides.reverse()
    index = torch.zeros((), dtype=torch.int64)
    for dim, (start, size, step) in enumerate(zip(offsets, sizes, strides)):
        view = [1] * len(sizes)
        view[dim] = int(size)
        index = index + (torch.arange(int(start), int(start) + int(size), dtype=torch.int64) * step).view(view)
    return index.expand(tuple(int(s) for s in sizes))


def counter_box(key: int, full: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
                transform: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """float32 box: ``transform`` (p in (0, 1) -> value) of each element's :func:`open_unit`, slab by slab along
    the first dimension so that the temporaries stay small."""
    if math.prod(int(n) for n in full) > _MAX_ELEMENTS:
        raise ValueError(f"a parameter of shape {tuple(full)} has more than 2^31 elements: the seeded init "
                         f"addresses fewer")
    sizes = tuple(int(s) for s in sizes)
    out = torch.empty(sizes, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if not sizes:
        return transform(open_unit(counter_hash(flat_indices(full, offsets, sizes), key)))
    rows = max(1, _CHUNK // max(1, out[0].numel()))
    for first in range(0, sizes[0], rows):
        count = min(rows, sizes[0] - first)
        index = flat_indices(full, (int(offsets[0]) + first,) + tuple(offsets[1:]), (count,) + sizes[1:])
        out[first:first + count] = transform(open_unit(counter_hash(index, key)))
    return out


def set_init(param: torch.Tensor, fn: InitFn) -> None:
    """Attach the init rule ``fn(key, full_shape, offsets, sizes) -> box`` to ``param``."""
    setattr(param, _INIT_ATTR, fn)


def uniform_fan_in(fan_in: int) -> InitFn:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's default for nn.Linear weights and biases."""
    bound = 1.0 / math.sqrt(max(fan_in, 1))

    def init(key: int, full: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        return counter_box(key, full, offsets, sizes, lambda p: p.mul_(2.0).sub_(1.0).mul_(bound))

    return init


def normal_init(std: float) -> InitFn:
    """N(0, std^2)."""

    def init(key: int, full: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        return counter_box(key, full, offsets, sizes, lambda p: inverse_normal_cdf(p).mul_(std))

    return init


def constant_init(value: float) -> InitFn:
    """Every element equal to ``value`` (ones for norm scales, zeros for LoRA B)."""

    def init(key: int, full: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        return torch.full(tuple(int(s) for s in sizes), float(value), dtype=torch.float32)

    return init


def param_key(seed: int, name: str) -> int:
    """The generator key of the parameter ``name`` under ``seed`` (64 bits of BLAKE2b, stable across runs)."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, seed: int) -> None:
    """Initialise one parameter, known in the model as ``name``, from its init rule: this rank's TP slice only."""
    fn = getattr(param, _INIT_ATTR, None)
    if fn is None:
        raise ValueError(f"parameter {name} has no init rule (use common.init.set_init)")
    if param.is_meta:
        return  # built on the meta device: filled after sharding (common.materialize)
    offsets = [0] * param.dim()
    if is_tp_partitioned(param):
        offsets[param.partition_dim] = tp_rank() * param.shape[param.partition_dim]
    box = fn(param_key(seed, name), tuple(full_shape(param)), offsets, tuple(param.shape))
    param.copy_(box.to(dtype=param.dtype))


def init_parameters(model: torch.nn.Module, seed: int) -> None:
    """Initialise every parameter of ``model`` from its init rule, identically at every layout (module doc)."""
    for name, param in model.named_parameters():
        init_parameter(param, name, seed)
