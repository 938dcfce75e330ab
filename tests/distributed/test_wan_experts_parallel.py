"""Two experts at world size 2 (FSDP2 over both ranks; pipeline stages, CP 2 and TP 2; one spawn): Native, Retain
and Reweight agree as on one transformer (Retain bitwise, Reweight at the fp32 floor) and with the single-process
run; with ``experts.train: high`` the low-noise expert is bitwise unchanged. With DanceGRPO selection the ranks
train different steps, so one rank's update may run one expert while the other's runs the other: the units stay
gathered and the gradients are reduced once, densely (a rank with no gradient of an expert contributes zeros);
the layouts that would pair different experts' collectives are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.unit.test_schedules_parity import bitwise, check_parity, rel_l2, run_case
from tests.unit.test_wan_experts_parity import EXPERTS
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

# per-sample steps: one of steps 0-2 of the DanceGRPO schedule (timesteps 1000, 900, 750: steps 0 and 1 run the
# high-noise expert). Training both, rank 0's second unit runs the low-noise expert while rank 1's runs the
# high-noise one; training one, only its steps train: some samples train nothing, and training the low-noise one,
# rank 1 (whose samples drew steps 0 and 1) trains nothing at all and reduces zeros
DANCE = EXPERTS.but(selection="dance_grpo", fraction=0.5, advantage="dance_grpo", sde_kind="dance_grpo",
                    reshard=False, sync="coalesced")
DANCE_HIGH = DANCE.but(experts="high")


def _configurations(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    out = {}
    for train in ("both", "high"):
        for schedule in ("native", "retain", "reweight"):
            out[f"{train}_{schedule}"] = run_case(EXPERTS.but(experts=train, schedule=schedule))
        # Native synced as Retain (once, coalesced): then Retain is bitwise Native
        out[f"{train}_coalesced"] = run_case(EXPERTS.but(experts=train, sync="coalesced"))
    for train in ("both", "high", "low"):
        for schedule in ("native", "retain", "reweight"):
            out[f"dance_{train}_{schedule}"] = run_case(DANCE.but(experts=train, schedule=schedule))
    for name, case in (("regather", DANCE_HIGH.but(reshard=True)), ("per_backward", DANCE_HIGH.but(sync=None))):
        try:
            run_case(case)
        except ValueError as err:
            out[f"refused_{name}"] = str(err)
    destroy_parallel_context()
    # the two ranks as pipeline stages, as the CP ranks of one sample, as the TP ranks of every layer
    for kind, case in (("pp", EXPERTS.but(pp=2)), ("cp", EXPERTS.but(cp=2, sync="coalesced")),
                       ("tp", EXPERTS.but(tp=2))):
        for schedule in ("native", "retain", "reweight"):
            out[f"{kind}_{schedule}"] = run_case(case.but(experts="high", schedule=schedule))
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
@once_per_process
def results():
    ranks = run_ranks(_configurations, 2, timeout=500)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = {train: run_case(EXPERTS.but(experts=train)) for train in ("both", "high")}
        reference.update({f"dance_{train}": run_case(DANCE.but(experts=train)) for train in ("both", "high", "low")})
    finally:
        torch.set_num_threads(threads)
    return ranks, reference


def test_schedules_agree_at_world_size_2(results):
    ranks, reference = results
    for out in ranks:
        for train in ("both", "high"):
            native, retain, reweight = (out[f"{train}_{s}"] for s in ("coalesced", "retain", "reweight"))
            check_parity(native, retain, reweight)
            assert rel_l2(out[f"{train}_native"].grads[0], native.grads[0]) < 1e-6
            assert np.array_equal(native.rewards, reference[train].rewards)
            assert rel_l2(reference[train].grads[0], native.grads[0]) < 1e-6
            assert rel_l2(reference[train].params, native.params) < 1e-6
        experts = {name.split(".")[0] for name in out["both_native"].names}
        assert experts == {"high", "low"}
        assert all(name.startswith("high.") for name in out["high_native"].names)
    assert not np.array_equal(ranks[0]["both_native"].trajectory, ranks[1]["both_native"].trajectory)


def test_frozen_expert_is_bitwise_unchanged(results):
    ranks, reference = results
    from leangrpo_mcore.models import build_policy

    initial = dict(build_policy({"family": "wan", "preset": "wan-tiny-a14b"}, seed=0, backend="local")
                   .named_parameters())
    for out in ranks:
        for key in ("high_native", "high_retain", "high_reweight", "dance_high_native", "dance_high_reweight"):
            frozen = out[key].frozen
            assert sorted(frozen) == sorted(n for n in initial if n.startswith("low."))
            assert all(np.array_equal(v, initial[n].detach().numpy()) for n, v in frozen.items())


def test_ranks_running_different_experts(results):
    ranks, reference = results
    for out in ranks:
        for train in ("both", "high", "low"):
            native, retain, reweight = (out[f"dance_{train}_{s}"] for s in ("native", "retain", "reweight"))
            check_parity(native, retain, reweight)
            assert np.array_equal(native.rewards, reference[f"dance_{train}"].rewards)
            assert rel_l2(reference[f"dance_{train}"].grads[0], native.grads[0]) < 1e-6
            assert bitwise(ranks[0][f"dance_{train}_retain"].params, out[f"dance_{train}_retain"].params)
        assert "parallel.reshard_after_forward=false" in out["refused_regather"]
        assert "schedule.coalesce_sync=true" in out["refused_per_backward"]


def test_pipeline_stages_context_and_tensor_parallelism(results):
    ranks, reference = results
    for rank, out in enumerate(ranks):
        for kind in ("pp", "cp", "tp"):
            native, retain, reweight = (out[f"{kind}_{s}"] for s in ("native", "retain", "reweight"))
            check_parity(native, retain, reweight, tol=3e-6)
            assert all(name.startswith("high.") for name in native.names)
            if kind != "pp":  # a stage holds its own blocks: compared below
                assert rel_l2(reference["high"].grads[0], native.grads[0]) < 1e-5
        stage = out["pp_native"]
        mine = dict(zip(reference["high"].names, reference["high"].grads[0]))
        assert rel_l2([mine[name] for name in stage.names], stage.grads[0]) < 1e-5
        assert any(f"layers.{rank}." in name for name in stage.names)  # stage k holds block k of each expert
        assert all(np.array_equal(v, reference["high"].frozen[n]) for n, v in stage.frozen.items())
