import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), dist.get_backend()


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_two_ranks_all_reduce():
    out = run_ranks(_all_reduce, 2)
    assert out == [(3.0, "gloo"), (3.0, "gloo")]


def test_rank_traceback_is_surfaced():
    with pytest.raises(RuntimeError, match=r"(?s)ranks \[1\].*ValueError: boom on rank one"):
        run_ranks(_fails_on_rank_one, 2, timeout=60)
