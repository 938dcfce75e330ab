"""Modules' extra state through a training checkpoint on 2 gloo ranks: under FSDP2 (both ranks one TP rank, the
state written once) and at TP=2 (a state per TP rank, each rank restores its own); the TP=2 checkpoint then
loads in one process, which restores TP rank 0's state."""

import os

import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.extra_state_probe import attach_probes, tiny_flux_inputs

pytestmark = pytest.mark.distributed

TINY = {"family": "flux", "preset": "flux-tiny"}


def _parts(seed, start):
    from leangrpo_mcore.engine import checkpoint as ck
    from leangrpo_mcore.models import build_policy

    model = build_policy(TINY, seed=seed, backend="local")
    probes = attach_probes(model, start)
    return model, ck.capture_tp_layout(model), probes


def _states(probes):
    return {name: probe.get_extra_state() for name, probe in probes.items()}


def _round_trip(ctx, root, tp_rank):
    from leangrpo_mcore.engine import checkpoint as ck
    from leangrpo_mcore.engine.output.run_dir import RunDir
    from leangrpo_mcore.parallel.fsdp import apply_fsdp

    model, layout, probes = _parts(seed=0, start=0.0)
    apply_fsdp(model, ctx)
    with torch.no_grad():
        model(**tiny_flux_inputs())
    for probe in probes.values():  # TE's state may differ per TP rank; this one does
        probe.amax_history[1] = 10.0 * tp_rank + 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = ck.save_checkpoint(RunDir(root), 1, model=model, optimizer=optimizer, lr_scheduler=None, ema=None,
                              layout=layout, state={"sampler": {}}, config_yaml="").finish()
    other, layout2, probes2 = _parts(seed=1, start=7.0)
    apply_fsdp(other, ctx)
    warnings = []
    ck.load_checkpoint(path, model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                       lr_scheduler=None, ema=None, layout=layout2, same_layout=True, warn=warnings.append)
    return _states(probes), _states(probes2), warnings


def _rank(rank, world_size, root):
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context

    out = {}
    for tp in (1, 2):
        ctx = build_parallel_context(Layout(tp=tp))
        try:
            if tp == 1:
                assert ctx.dp_mesh is not None and ctx.dp_mesh.size() == 2  # FSDP2 over both ranks
            out[tp] = _round_trip(ctx, os.path.join(root, f"tp{tp}"), ctx.tp_rank)
        finally:
            destroy_parallel_context()
    return out


def _equal(a, b):
    def same(x, y):
        return (x["steps"] == y["steps"] and torch.equal(x["scale"], y["scale"])
                and torch.equal(x["amax_history"], y["amax_history"]))
    return a.keys() == b.keys() and all(same(a[n], b[n]) for n in a)


def test_extra_state_round_trips_under_fsdp2_and_tp2(tmp_path):
    from leangrpo_mcore.engine import checkpoint as ck

    for tp in (1, 2):
        os.makedirs(tmp_path / f"tp{tp}" / "checkpoints")
    results = run_ranks(_rank, 2, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        for tp in (1, 2):
            saved, restored, warnings = out[tp]
            assert warnings == []
            assert saved["probe"]["steps"] == 1 and float(saved["probe"]["amax_history"][0]) > 0
            assert _equal(restored, saved), (rank, tp)
            expected = 10.0 * rank + 1.0 if tp == 2 else 1.0
            assert float(restored["transformer_blocks.0.probe"]["amax_history"][1]) == expected
    assert _equal(results[0][1][0], results[1][1][0])  # the FSDP2 replicas agree
    assert not _equal(results[0][2][0], results[1][2][0])  # the TP ranks do not

    model, layout, probes = _parts(seed=2, start=7.0)
    path = str(tmp_path / "tp2" / "checkpoints" / "step_1")
    ck.load_checkpoint(path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       lr_scheduler=None, ema=None, layout=layout, same_layout=False, warn=pytest.fail)
    assert _equal(_states(probes), results[0][2][0])  # at TP=1: TP rank 0's state
