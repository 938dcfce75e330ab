"""The counter-based seeded init: its hash equals the same hash in plain Python integers, its normal equals the
standard library's inverse CDF, a box equals the same box cut from the whole tensor bit for bit (any split, any
slab size), and the drawn values have the target distribution. (Layouts at world size 2: test_sharded_load.)"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from leangrpo_mcore.models.common import init


def _triple32(x: int) -> int:
    """Wellons' triple32, as published (unsigned 32-bit arithmetic)."""
    mask = 0xFFFFFFFF
    x ^= x >> 17
    x = (x * 0xED5AD4BB) & mask
    x ^= x >> 11
    x = (x * 0xAC4C1B51) & mask
    x ^= x >> 15
    x = (x * 0x31848BAB) & mask
    x ^= x >> 14
    return x


def test_the_hash_is_triple32_of_the_counter_in_plain_integers():
    key = init.param_key(3, "blocks.0.attn.qkv.weight")
    indices = [0, 1, 2, 12345, 2**31 - 1, 2**30 + 7]
    got = init.counter_hash(torch.tensor(indices, dtype=torch.int64), key)
    for index, value in zip(indices, got.tolist()):
        expected = _triple32(_triple32((index + key) & 0xFFFFFFFF) ^ (key >> 32 & 0xFFFFFFFF))
        assert value & 0xFFFFFFFF == expected


def test_the_key_depends_on_seed_and_name():
    keys = {init.param_key(s, n) for s in (0, 1) for n in ("a.weight", "b.weight")}
    assert len(keys) == 4 and init.param_key(0, "a.weight") == init.param_key(0, "a.weight")


def test_inverse_normal_cdf_matches_the_standard_library():
    ps = [2.0**-24, 1e-6, 1e-3, 0.0242, 0.02426, 0.1, 0.3, 0.5, 0.7, 0.97574, 0.9758, 0.999, 1 - 2.0**-24]
    got = init.inverse_normal_cdf(torch.tensor(ps, dtype=torch.float32))
    for p, value in zip(ps, got.tolist()):
        expected = statistics.NormalDist().inv_cdf(float(torch.tensor(p, dtype=torch.float32)))
        assert abs(value - expected) <= 3e-7 * max(1.0, abs(expected)), (p, value, expected)  # float32


@pytest.mark.parametrize("rule", [init.normal_init(0.5), init.uniform_fan_in(10)], ids=["normal", "uniform"])
def test_a_box_equals_the_same_box_of_the_whole_tensor(monkeypatch, rule):
    key, full = init.param_key(0, "w"), (37, 6, 5)
    whole = rule(key, full, (0, 0, 0), full)
    monkeypatch.setattr(init, "_CHUNK", 7)  # slabs of one row: every other cut through the tails' code path
    assert torch.equal(rule(key, full, (0, 0, 0), full), whole)
    for offsets, sizes in [((0, 0, 0), (19, 6, 5)), ((19, 0, 0), (18, 6, 5)), ((5, 2, 1), (13, 3, 4)),
                           ((36, 5, 4), (1, 1, 1))]:
        box = rule(key, full, offsets, sizes)
        cut = whole[offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1],
                    offsets[2]:offsets[2] + sizes[2]]
        assert torch.equal(box, cut), (offsets, sizes)


def test_the_values_have_the_target_distribution():
    n, std = 1 << 18, 0.02
    normal = init.normal_init(std)(init.param_key(0, "w"), (512, 512), (0, 0), (512, 512)).double()
    assert abs(normal.mean().item()) < 4 * std / math.sqrt(n)
    assert abs(normal.std().item() / std - 1) < 0.006  # 4 standard errors
    assert abs(((normal / std) ** 4).mean().item() - 3.0) < 0.05  # the normal's kurtosis, not a uniform's 1.8
    bound = 1 / math.sqrt(64)
    uniform = init.uniform_fan_in(64)(init.param_key(0, "b"), (n,), (0,), (n,)).double()
    assert uniform.abs().max().item() <= bound
    assert abs(uniform.mean().item()) < 4 * bound / math.sqrt(3 * n)
    assert abs(uniform.std().item() / (bound / math.sqrt(3)) - 1) < 0.004
    other = init.normal_init(std)(init.param_key(0, "w2"), (512, 512), (0, 0), (512, 512)).double()
    assert abs(torch.corrcoef(torch.stack([normal.flatten(), other.flatten()]))[0, 1].item()) < 0.01


def test_init_parameter_fills_the_tp_slice_of_the_full_tensor():
    param = torch.nn.Parameter(torch.empty(4, 3))
    init.set_init(param, init.normal_init(1.0))
    init.init_parameter(param, "x.weight", seed=5)
    whole = init.normal_init(1.0)(init.param_key(5, "x.weight"), (4, 3), (0, 0), (4, 3))
    assert torch.equal(param.detach(), whole)
