"""Assembly plans: our tensors as concatenations of stored tensors, in both directions and by slices."""

import pytest
import torch

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.assembly import Assembly, Piece, assemble, disassemble, identity


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
