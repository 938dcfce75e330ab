"""Modules' extra state (``get_extra_state``, Transformer Engine's FP8 metadata) in training checkpoints, on one
process: the values round-trip through save and resume, a checkpoint without it loads with a warning, and at
another TP degree every rank reads TP rank 0's entry."""

import io
import os

import pytest
import torch

from leangrpo_mcore.engine import checkpoint as ck
from leangrpo_mcore.engine.checkpoint import extra_state
from leangrpo_mcore.engine.output.run_dir import RunDir
from leangrpo_mcore.models import build_policy
from tests.extra_state_probe import ExtraStateProbe, attach_probes, same_state, tiny_flux_inputs

TINY = {"family": "flux", "preset": "flux-tiny"}


def _parts(seed: int, probes: bool, start: float = 0.0):
    model = build_policy(TINY, seed=seed, backend="local")
    found = attach_probes(model, start) if probes else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, ck.capture_tp_layout(model), optimizer, found


def _save(tmp_path, model, layout, optimizer, async_save=False):
    run_dir = RunDir(str(tmp_path / "run"))
    os.makedirs(run_dir.checkpoints_dir, exist_ok=True)
    return ck.save_checkpoint(run_dir, 1, model=model, optimizer=optimizer, lr_scheduler=None, ema=None,
                              layout=layout, state={"sampler": {}}, config_yaml="",
                              async_save=async_save).finish()


def _load(path, model, layout, optimizer):
    warnings = []
    ck.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=None, ema=None, layout=layout,
                       same_layout=True, warn=warnings.append)
    return warnings


@pytest.mark.parametrize("async_save", [False, True])
def test_extra_state_round_trips_through_save_and_resume(tmp_path, async_save):
    model, layout, optimizer, probes = _parts(0, probes=True)
    with torch.no_grad():
        for _ in range(2):
            model(**tiny_flux_inputs())
    saved = {name: probe.get_extra_state() for name, probe in probes.items()}
    assert sorted(saved) == ["probe", "transformer_blocks.0.probe"]
    assert saved["probe"]["steps"] == 2 and float(saved["transformer_blocks.0.probe"]["scale"][0]) > 0
    path = _save(tmp_path, model, layout, optimizer, async_save)
    with torch.no_grad():
        model(**tiny_flux_inputs())  # a later forward must not reach the checkpoint (async: staged at save time)

    other, layout2, opt2, probes2 = _parts(1, probes=True, start=7.0)
    assert not any(same_state(probes2[n], probes[n]) for n in probes)
    assert _load(path, other, layout2, opt2) == []
    for name, probe in probes2.items():
        state = probe.get_extra_state()
        assert state["steps"] == saved[name]["steps"], name
        assert torch.equal(state["scale"], saved[name]["scale"]), name
        assert torch.equal(state["amax_history"], saved[name]["amax_history"]), name
    assert probes["probe"].get_extra_state()["steps"] == 3  # the live module moved on after the save


def test_checkpoint_without_extra_state_loads_with_a_warning(tmp_path):
    model, layout, optimizer, _ = _parts(0, probes=False)
    path = _save(tmp_path, model, layout, optimizer)
    plain, layout2, opt2, _ = _parts(1, probes=False)
    assert _load(path, plain, layout2, opt2) == []  # megatron's local linears return None: nothing to save

    probed, layout3, opt3, probes = _parts(1, probes=True, start=7.0)
    warnings = _load(path, probed, layout3, opt3)
    assert len(warnings) == 1 and path in warnings[0] and "for 2 module(s)" in warnings[0]
    assert "'transformer_blocks.0.probe'" in warnings[0]
    assert probes["probe"].get_extra_state()["steps"] == 0
    assert float(probes["probe"].amax_history[0]) == 7.5
    for (name, a), b in zip(model.named_parameters(), probed.parameters()):
        assert torch.equal(a, b), name


def test_extra_state_of_modules_this_model_lacks_is_ignored_with_a_warning(tmp_path):
    model, layout, optimizer, _ = _parts(0, probes=True)
    path = _save(tmp_path, model, layout, optimizer)
    plain, layout2, opt2, _ = _parts(1, probes=False)
    warnings = _load(path, plain, layout2, opt2)
    assert len(warnings) == 1 and "extra state of 2 module(s) that have none here" in warnings[0]


def test_another_tp_degree_reads_tp_rank_0s_entry():
    model = torch.nn.Module()
    model.probe = ExtraStateProbe()
    keys = [f"extra/probe._extra_state/tp_{r}" for r in range(2)] + ["model/w"]
    assert extra_state.stored_modules(keys) == {"probe": 2}

    def targets(tp, tp_size):
        return sorted(extra_state.load_targets("ckpt", model, keys, tp, tp_size, warn=pytest.fail))
    assert targets(1, 2) == ["extra/probe._extra_state/tp_1"]  # same degree: each rank its own
    assert targets(0, 2) == ["extra/probe._extra_state/tp_0"]
    assert targets(3, 4) == ["extra/probe._extra_state/tp_0"]  # another degree: TP rank 0's
    assert targets(0, 1) == ["extra/probe._extra_state/tp_0"]
    assert extra_state.save_entries(model, 1).keys() == {"extra/probe._extra_state/tp_1"}


def test_serialized_states_come_back_equal():
    te_like = torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8)  # TE's pickled None
    assert torch.equal(extra_state.deserialize(extra_state.serialize(te_like)), te_like)
    old = extra_state.deserialize(extra_state.serialize(io.BytesIO(b"fp8 meta")))
    assert isinstance(old, io.BytesIO) and old.getvalue() == b"fp8 meta"
