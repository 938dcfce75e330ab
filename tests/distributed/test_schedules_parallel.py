"""Schedule parity on 2 gloo ranks: FSDP2 (shared and conventional layouts) and tensor parallelism (TP=2), FLUX,
FLUX.1-Kontext (reference tokens), Wan and SD3.

One spawn runs every configuration on both ranks (start-up dominates the cost); the tests below read its
results. Retain is bitwise equal to Native under the same gradient-sync mode (both per backward, or both
coalesced), Reweight within 1e-6 relative L2, and rewards match the single-process run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.unit.test_schedules_parity import GUARD, KONTEXT, MIX_FLASH, Case, bitwise, check_parity, rel_l2, run_case
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

FLUX = Case(family="flux")
WAN_LORA_KL = Case(family="wan", lora=True, kl_beta=20.0, global_std=True)
SD3_CFG_LORA_KL = Case(family="sd3", lora=True, kl_beta=10.0)  # dual attention, CFG with negative pooled
# per-sample selected steps and a second (Native) update after the first optimizer step
GATHERED = FLUX.but(selection="dance_grpo", fraction=0.5, updates=2)


def _all_configurations(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    runs = {
        "shared_native": FLUX,
        "shared_native_coalesced": FLUX.but(sync="coalesced"),
        "shared_retain": FLUX.but(schedule="retain"),
        "shared_retain_per_backward": FLUX.but(schedule="retain", sync="per_backward"),
        "shared_reweight": FLUX.but(schedule="reweight"),
        "shared_native_mb2": FLUX.but(micro_batch=2),
        "shared_reweight_mb2": FLUX.but(schedule="reweight", micro_batch=2),
        "conv_native": WAN_LORA_KL.but(layout="conventional"),
        "conv_retain": WAN_LORA_KL.but(layout="conventional", schedule="retain", sync="per_backward"),
        "conv_reweight": WAN_LORA_KL.but(layout="conventional", schedule="reweight", accumulate="affine"),
        # Native's gradients synced as Retain's (coalesced): then Retain is bitwise Native
        "sd3_shared_native": SD3_CFG_LORA_KL.but(sync="coalesced"),
        **{f"sd3_shared_{name}": SD3_CFG_LORA_KL.but(schedule=name) for name in ("retain", "reweight")},
        # FLUX.1-Kontext: reference tokens in every forward (Native synced as Retain, coalesced)
        "kontext_native": KONTEXT.but(sync="coalesced"),
        **{f"kontext_{name}": KONTEXT.but(schedule=name) for name in ("retain", "reweight")},
    }
    for schedule in ("native", "retain", "reweight"):
        runs[f"gathered_{schedule}"] = GATHERED.but(schedule=schedule, reshard=False)
    runs.update(sharded_native=GATHERED.but(reshard=True), sharded_retain=GATHERED.but(schedule="retain", reshard=True),
                auto_reweight=GATHERED.but(schedule="reweight"))
    for schedule in ("native", "retain", "reweight"):  # a shared window: Reweight may reshard
        runs[f"mix_{schedule}"] = MIX_FLASH.but(schedule=schedule, reshard=True, sync="coalesced")
        runs[f"guard_{schedule}"] = GUARD.but(schedule=schedule, sync="coalesced")
    out = {name: run_case(case) for name, case in runs.items()}
    try:
        run_case(GATHERED.but(schedule="reweight", reshard=True))
    except ValueError as err:
        out["refused"] = str(err)
    destroy_parallel_context()
    for family, case in (("flux", FLUX), ("wan", WAN_LORA_KL), ("sd3", SD3_CFG_LORA_KL), ("kontext", KONTEXT)):
        for schedule in ("native", "retain", "reweight"):
            out[f"tp_{family}_{schedule}"] = run_case(case.but(tp=2, schedule=schedule))
        destroy_parallel_context()
    return out


@pytest.fixture(scope="module")
@once_per_process
def results():
    ranks = run_ranks(_all_configurations, 2, timeout=560)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded kernels; so must the reference
    try:
        reference = {"flux": run_case(FLUX), "wan": run_case(WAN_LORA_KL), "sd3": run_case(SD3_CFG_LORA_KL),
                     "mix": run_case(MIX_FLASH), "kontext": run_case(KONTEXT), "guard": run_case(GUARD)}
    finally:
        torch.set_num_threads(threads)
    return ranks, reference


def test_fsdp_shared_layout(results):
    ranks, reference = results
    for out in ranks:
        check_parity(out["shared_native_coalesced"], out["shared_retain"], out["shared_reweight"])
        check_parity(out["shared_native"], out["shared_retain_per_backward"], out["shared_reweight"])
        assert rel_l2(out["shared_native"].grads[0], out["shared_native_coalesced"].grads[0]) < 1e-6
        assert np.array_equal(out["shared_native"].rewards, reference["flux"].rewards)
        assert rel_l2(reference["flux"].grads[0], out["shared_native"].grads[0]) < 1e-6
        assert math.isclose(out["shared_native"].grad_norms[0], reference["flux"].grad_norms[0], rel_tol=1e-6)
        # two samples per forward: one provisional gradient per sample through the batched graph
        assert rel_l2(out["shared_native_mb2"].grads[0], out["shared_reweight_mb2"].grads[0]) < 1e-6
    # the shared layout splits every group: rank r made generations r and r + 2 of each prompt
    assert not np.array_equal(ranks[0]["shared_native"].trajectory, ranks[1]["shared_native"].trajectory)
    assert bitwise(ranks[0]["shared_retain"].params, ranks[1]["shared_retain"].params)


def test_progressive_window_dpmpp_2m_compressed(results):
    """MixGRPO-Flash's sampler under FSDP2 (shared layout): the schedules agree, and with the single process."""
    ranks, reference = results
    for out in ranks:
        check_parity(out["mix_native"], out["mix_retain"], out["mix_reweight"])
        assert np.array_equal(out["mix_native"].rewards, reference["mix"].rewards)
        assert rel_l2(reference["mix"].grads[0], out["mix_native"].grads[0]) < 1e-6


def test_grpo_guard_two_updates(results):
    """GRPO-Guard under FSDP2 (shared layout): the schedules agree on both updates (the second off-policy), and with
    the single process."""
    ranks, reference = results
    for out in ranks:
        check_parity(out["guard_native"], out["guard_retain"], out["guard_reweight"], tol=2e-6)
        assert np.array_equal(out["guard_native"].rewards, reference["guard"].rewards)
        assert len(out["guard_native"].grads) == 2
        for ours, single in zip(out["guard_native"].grads, reference["guard"].grads):
            assert rel_l2(single, ours) < 1e-6


def test_parameters_kept_gathered_through_the_step(results):
    """reshard_after_forward=False: same numbers as resharding (no stale gathered copy after an optimizer
    step); DanceGRPO selection differs per rank, so Reweight keeps parameters gathered by default and refuses
    to reshard (its immediate backwards would pair all-gathers of different blocks across ranks)."""
    ranks, _ = results
    for out in ranks:
        for schedule in ("native", "retain"):
            sharded, gathered = out[f"sharded_{schedule}"], out[f"gathered_{schedule}"]
            assert len(gathered.grads) == 2  # the second update recomputes after the first optimizer step
            assert np.array_equal(sharded.trajectory, gathered.trajectory)
            assert all(bitwise(s, g) for s, g in zip(sharded.grads, gathered.grads))
            assert bitwise(sharded.params, gathered.params)
        native, reweight = out["sharded_native"], out["gathered_reweight"]
        assert np.array_equal(native.trajectory, reweight.trajectory)
        assert all(rel_l2(n, w) < 1e-6 for n, w in zip(native.grads, reweight.grads))
        assert rel_l2(native.params, reweight.params) < 1e-6
        assert bitwise(out["auto_reweight"].params, reweight.params)
        assert "parallel.reshard_after_forward=false" in out["refused"]


def test_fsdp_conventional_layout_wan_cfg_lora_kl(results):
    ranks, reference = results
    for out in ranks:
        check_parity(out["conv_native"], out["conv_retain"], out["conv_reweight"])
        assert np.array_equal(out["conv_native"].rewards, reference["wan"].rewards)
        assert rel_l2(reference["wan"].grads[0], out["conv_native"].grads[0]) < 1e-6


def test_fsdp_shared_layout_sd3_cfg_lora_kl(results):
    ranks, reference = results
    for out in ranks:
        check_parity(out["sd3_shared_native"], out["sd3_shared_retain"], out["sd3_shared_reweight"])
        assert np.array_equal(out["sd3_shared_native"].rewards, reference["sd3"].rewards)
        assert rel_l2(reference["sd3"].grads[0], out["sd3_shared_native"].grads[0]) < 1e-6
        assert math.isclose(out["sd3_shared_native"].grad_norms[0], reference["sd3"].grad_norms[0], rel_tol=1e-6)


def test_fsdp_shared_layout_flux_kontext_lora_kl(results):
    ranks, reference = results
    for out in ranks:
        check_parity(out["kontext_native"], out["kontext_retain"], out["kontext_reweight"])
        assert np.array_equal(out["kontext_native"].rewards, reference["kontext"].rewards)
        assert rel_l2(reference["kontext"].grads[0], out["kontext_native"].grads[0]) < 1e-6
        assert math.isclose(out["kontext_native"].grad_norms[0], reference["kontext"].grad_norms[0], rel_tol=1e-6)
    assert not np.array_equal(ranks[0]["kontext_native"].trajectory, ranks[1]["kontext_native"].trajectory)


def test_tensor_parallel(results):
    ranks, reference = results
    for out in ranks:
        for family in ("flux", "wan", "sd3", "kontext"):
            native, retain, reweight = (out[f"tp_{family}_{s}"] for s in ("native", "retain", "reweight"))
            check_parity(native, retain, reweight)
            np.testing.assert_allclose(native.rewards, reference[family].rewards, rtol=1e-5, atol=1e-5)
            assert rel_l2(reference[family].grads[0], native.grads[0]) < 1e-4
            # the norm counts TP-partitioned weights once per shard and replicated ones once (Wan clips: norm > 1)
            assert math.isclose(native.grad_norms[0], reference[family].grad_norms[0], rel_tol=1e-4)
            assert rel_l2(reference[family].params, native.params) < 1e-4
    # both TP ranks make the same samples
    assert np.array_equal(ranks[0]["tp_flux_native"].trajectory, ranks[1]["tp_flux_native"].trajectory)
