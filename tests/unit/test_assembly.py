"""Assembly plans: our tensors as concatenations of stored tensors, in both directions and by slices."""

import pytest
import torch

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.assembly import (Assembly, Piece, Source, assemble, disassemble, identity,
                                                   interleave, with_leading)


def _plan():
    qkv = Assembly((Piece("q", (4, 3), (4, 3)), Piece("k", (2, 3), (2, 3)), Piece("v", (2, 3), (2, 3))), dim=0)
    cols = Assembly((Piece("a", (2, 2), (2, 2)), Piece("b", (2, 5), (2, 5))), dim=1)
    conv = Assembly((Piece("conv", (3, 2, 1, 2), (3, 4)),))
    return {"qkv": qkv, "cols": cols, "conv": conv, "bias": identity("bias", (7,))}


def _stored():
    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (4, 3), "k": (2, 3), "v": (2, 3), "a": (2, 2), "b": (2, 5), "conv": (3, 2, 1, 2), "bias": (7,)}
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def test_assemble_concatenates_and_views_and_round_trips_bitwise():
    stored = _stored()
    ours = assemble(stored, _plan(), "test")
    assert torch.equal(ours["qkv"], torch.cat([stored["q"], stored["k"], stored["v"]]))
    assert torch.equal(ours["cols"], torch.cat([stored["a"], stored["b"]], dim=1))
    assert ours["conv"].shape == (3, 4) and torch.equal(ours["conv"][1], stored["conv"][1].flatten())
    assert ours["bias"].data_ptr() == stored["bias"].data_ptr()  # one piece: a view, no copy
    back = disassemble(ours, _plan(), "test")
    assert back.keys() == stored.keys() and all(torch.equal(back[k], stored[k]) for k in stored)


def test_pieces_along_maps_our_ranges_to_each_piece():
    qkv = _plan()["qkv"]
    assert qkv.full_shape == (8, 3)
    assert [(p.key, a, b) for p, a, b in qkv.pieces_along(3, 7)] == [("q", 3, 4), ("k", 0, 2), ("v", 0, 1)]
    assert [(p.key, a, b) for p, a, b in qkv.pieces_along(6, 8)] == [("v", 0, 2)]


def test_wrong_state_dicts_are_one_line_errors():
    stored = _stored()
    with pytest.raises(UserError, match="missing keys \\['k'\\]"):
        assemble({k: v for k, v in stored.items() if k != "k"}, _plan(), "test")
    with pytest.raises(UserError, match="unexpected keys"):
        assemble({**stored, "extra": torch.zeros(1)}, _plan(), "test")
    with pytest.raises(UserError, match="tensor q has shape \\(3, 3\\)"):
        assemble({**stored, "q": torch.zeros(3, 3)}, _plan(), "test")
    with pytest.raises(ValueError, match="keeps its first dimension"):
        Piece("x", (2, 6), (3, 4))


def _fused():
    """q, k, v (4 rows = 2 heads of 2 each) interleaved per head, and a (3, 2 + 4) weight interleaving its two
    column ranges (2 and 4 wide) per head."""
    qkv = interleave([Source(k, (4, 3), 0, 4) for k in ("q", "k", "v")], groups=2)
    cols = interleave([Source("w", (3, 6), 0, 2), Source("w", (3, 6), 2, 4)], groups=2, dim=1)
    return {"qkv": qkv, "cols": cols}


def test_interleave_orders_per_head_and_round_trips_bitwise():
    gen = torch.Generator().manual_seed(1)
    stored = {k: torch.randn(4, 3, generator=gen) for k in ("q", "k", "v")}
    stored["w"] = torch.randn(3, 6, generator=gen)
    ours = assemble(stored, _fused(), "test")
    q, k, v = stored["q"], stored["k"], stored["v"]
    assert torch.equal(ours["qkv"], torch.cat([q[:2], k[:2], v[:2], q[2:], k[2:], v[2:]]))
    w = stored["w"]
    assert torch.equal(ours["cols"], torch.cat([w[:, 0:1], w[:, 2:4], w[:, 1:2], w[:, 4:6]], dim=1))
    back = disassemble(ours, _fused(), "test")
    assert back.keys() == stored.keys() and all(torch.equal(back[key], stored[key]) for key in stored)
    # The first half of ours (one TP rank of two) is head 0 of every source.
    assert [(p.key, p.start, a, b) for p, a, b in _fused()["qkv"].pieces_along(0, 6)] == [
        ("q", 0, 0, 2), ("k", 0, 0, 2), ("v", 0, 0, 2)]
    a_plan = with_leading(_fused()["cols"], 5, lambda key: key + ".A")
    a = torch.randn(5, 6, generator=gen)
    assert torch.equal(disassemble({"a": a}, {"a": a_plan}, "test")["w.A"][:, [0, 2, 3, 1, 4, 5]], a)


def test_sharded_boxes_read_interleaved_slices():
    from leangrpo_mcore.models.common.checkpoint import MemorySource
    from leangrpo_mcore.models.common.materialize import assembled_boxes

    gen = torch.Generator().manual_seed(2)
    stored = {k: torch.randn(4, 3, generator=gen) for k in ("q", "k", "v")}
    stored["w"] = torch.randn(3, 6, generator=gen)
    read = assembled_boxes(MemorySource(stored), _fused())
    ours = assemble(stored, _fused(), "test")
    assert torch.equal(read("qkv", (6, 1), (6, 2)), ours["qkv"][6:, 1:])
    assert torch.equal(read("cols", (1, 3), (2, 3)), ours["cols"][1:, 3:])
    assert torch.equal(read("qkv", (1, 0), (4, 3)), ours["qkv"][1:5])


def test_slices_that_do_not_tile_their_tensor_are_refused():
    plan = {"x": Assembly((Piece("q", (4, 3), (2, 3), start=0), Piece("q", (4, 3), (1, 3), start=3)))}
    with pytest.raises(ValueError, match="do not tile"):
        disassemble({"x": torch.zeros(3, 3)}, plan, "test")
    with pytest.raises(ValueError, match="is not a slice"):
        Assembly((Piece("q", (4, 3), (2, 3), start=3),))
