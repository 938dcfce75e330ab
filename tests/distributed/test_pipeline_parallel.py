"""Pipeline parallelism (``parallel.pp``) on gloo ranks: one SGD step of Native, Retain and Reweight at pp=2
equals the same step at world size 1, and a checkpoint written at pp=2 continues at pp=1.

- pp=2 on 2 ranks (one sample's two stages): FLUX full fine-tune, and Wan with LoRA, a KL term, CFG and
  global-std advantages; Native's no-grad rollout flows through the stages as megatron's forward-only schedule and
  its recompute as megatron's 1F1B schedule, Retain's rollout forward-only with its graphs kept, and Reweight's
  trained samples of each denoising step as one 1F1B schedule of their forwards and immediate backwards. Each stage's gradients are exactly its parameters' gradients of the world-size-1 step
  (the tests allow 1e-5 relative), the stages partition the trainable parameters, and both stages hold the
  rollout of the single-process run bit for bit, with its rewards, loss and global gradient norm.
- pp=2 x dp_shard=2 on 4 ranks: the same FLUX step with FSDP2 inside each stage (1e-5 relative: the
  reduce-scatter adds in another order); pp=2 x cp=2 on 4 ranks: FLUX and Wan with each sample's tokens split
  over the CP pair of every stage, still on megatron's pipelined schedules (1e-5).
- A 3-step pp=2 training run's step-2 checkpoint resumed at world size 1 ends where the pp=2 run ends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ckpt_helpers import model_tensors
from tests.distributed.launcher import run_ranks, train_ranks
from tests.unit.test_schedules_parity import KONTEXT, Case, rel_l2, run_case
from tests.once import once_per_process

pytestmark = pytest.mark.distributed

SCHEDULES = ("native", "retain", "reweight")
FLUX = Case(family="flux")
WAN = Case(family="wan", lora=True, kl_beta=20.0, global_std=True)
ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
TINY_SD3 = str(ROOT / "yaml_configs" / "tiny" / "sd3.yaml")  # CFG with the negative prompt, dual attention
# true CFG, masked text trimmed per step, the last block's idle text MLP (no gradient) in the checkpoint
TINY_QWEN = str(ROOT / "yaml_configs" / "tiny" / "qwen_image.yaml")
COMMON = ("reward.name=tests.unit.test_precision:contrast", "checkpoint.save_every=2", "train.max_steps=3",
          "logging.progress_bar=false", "logging.tensorboard=false", "schedule.name=retain")


def _run_all(rank: int, world_size: int, cases: dict) -> dict:
    """Every case on this rank, and the pipeline sizes megatron's ``get_forward_backward_func`` was asked for."""
    import megatron.core.pipeline_parallel as mcore_pp

    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    real, sizes = mcore_pp.get_forward_backward_func, {}

    def spied(pp_size=None, vp_size=None):
        inner = real(pp_size=pp_size, vp_size=vp_size)

        def counted(**call):
            sizes.setdefault(current, []).append((pp_size, call["num_microbatches"], call["forward_only"]))
            return inner(**call)

        return counted

    mcore_pp.get_forward_backward_func = spied
    out = {}
    try:
        for current, case in cases.items():
            out[current] = run_case(case)
    finally:
        mcore_pp.get_forward_backward_func = real
    destroy_parallel_context()
    return {**out, "pp_sizes": sizes}


def _reference(cases: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded kernels; so must the reference
    try:
        return {name: run_case(case.but(pp=1, layout="shared")) for name, case in cases.items()}
    finally:
        torch.set_num_threads(threads)


def _stage_grads(reference, outcome) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the reference's gradients of this stage's parameters, the stage's own), first update."""
    index = {name: i for i, name in enumerate(reference.names)}
    return [reference.grads[0][index[name]] for name in outcome.names], outcome.grads[0]


@pytest.fixture(scope="module")
@once_per_process
def two_stages():
    cases = {f"{family}_{schedule}": case.but(schedule=schedule, pp=2)
             for family, case in (("flux", FLUX), ("wan", WAN)) for schedule in SCHEDULES}
    # DanceGRPO's selection trains different steps per sample: a step mixes trained samples (1F1B) with
    # untrained ones (forward-only)
    cases["flux_reweight_dance"] = FLUX.but(schedule="reweight", pp=2, selection="dance_grpo", fraction=0.6,
                                            advantage="dance_grpo", num_steps=5)
    # FLUX.1-Kontext: the reference tokens travel in every boundary tensor
    cases["kontext_reweight"] = KONTEXT.but(schedule="reweight", pp=2)
    return run_ranks(_run_all, 2, cases, timeout=400), _reference(cases)


def test_pp2_equals_world_size_1(two_stages):
    ranks, reference = two_stages
    for rank in ranks:
        for family in ("flux", "wan"):
            calls = rank["pp_sizes"][f"{family}_native"]
            # Native's no-grad rollout: per group, each of the T = 4 steps one forward-only pipelined call over
            # the group's 4 micro-batches; its recompute: one 1F1B call per group over 4 samples x 3 steps, after
            # (with the KL term) one forward-only call of their reference forwards; Wan's global std defers every
            # group's update to the end of the rollout
            rollout, update = [(2, 4, True)] * 4, [(2, 12, True)] if family == "wan" else []
            update = update + [(2, 12, False)]
            expected = rollout * 2 + update * 2 if family == "wan" else (rollout + update) * 2
            assert calls == expected, (family, calls)
            # Retain: every step's forwards (trained ones too, graphs kept) one forward-only pipelined call over
            # the group's micro-batches; its deferred backward megatron's PP=1 scheduler on each stage
            retain = rank["pp_sizes"][f"{family}_retain"]
            kl = [(2, 12, True)] * 2 if family == "wan" else []  # the kept steps' reference forwards, per group
            assert [c for c in retain if c[2]] == [(2, 4, True)] * 8 + kl, (family, retain)
            assert {c[0] for c in retain if not c[2]} == {1}, (family, retain)
            # Reweight: at each of the 3 trained steps the group's 4 trained samples are one 1F1B call, each
            # sample's forward and immediate backward a micro-batch (with the KL term two: its KL part, then its
            # policy-gradient part, after a forward-only call of the reference forwards); the untrained step is a
            # forward-only call; nothing runs lock-step or on the PP=1 scheduler
            reweight = rank["pp_sizes"][f"{family}_reweight"]
            units = 8 if family == "wan" else 4
            assert [c for c in reweight if not c[2]] == [(2, units, False)] * 6, (family, reweight)
            assert [c for c in reweight if c[2]] == [(2, 4, True)] * (8 if family == "wan" else 2), (family, reweight)
        dance = rank["pp_sizes"]["flux_reweight_dance"]
        assert {c[0] for c in dance} == {2} and sum(c[1] for c in dance if not c[2]) == 2 * 4 * 2  # 2 steps each
    for name, ref in reference.items():
        first, last = ranks[0][name], ranks[1][name]
        assert first.names and last.names and not set(first.names) & set(last.names), name
        assert sorted(first.names + last.names) == sorted(ref.names), name
        for out in (first, last):
            expected, mine = _stage_grads(ref, out)
            assert rel_l2(expected, mine) <= 1e-5, name
            assert np.array_equal(out.trajectory, ref.trajectory), name
            assert np.array_equal(out.rewards, ref.rewards), name
            assert out.losses[0] == pytest.approx(ref.losses[0], rel=1e-6, abs=1e-12), name
            assert out.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-6), name
        expected, mine = _stage_grads(ref, first)
        assert max(float(np.abs(g).max()) for g in mine) > 0, name  # the first stage's gradient came back


@pytest.fixture(scope="module")
@once_per_process
def four_ranks():
    cases = {schedule: FLUX.but(schedule=schedule, pp=2) for schedule in SCHEDULES}
    return run_ranks(_run_all, 4, cases, timeout=500), _reference(cases)


def test_pp2_with_fsdp_inside_each_stage(four_ranks):
    ranks, reference = four_ranks
    for name, ref in reference.items():
        assert sorted(ranks[0][name].names + ranks[2][name].names) == sorted(ref.names), name
        for out in (rank[name] for rank in ranks):
            expected, mine = _stage_grads(ref, out)
            assert rel_l2(expected, mine) <= 1e-5, name
            assert np.array_equal(out.rewards, ref.rewards), name
            assert out.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-5), name
        # the two stages of a data-parallel index hold the same rollout; the two indices different samples
        assert np.array_equal(ranks[0][name].trajectory, ranks[2][name].trajectory)
        assert np.array_equal(ranks[1][name].trajectory, ranks[3][name].trajectory)
        assert not np.array_equal(ranks[0][name].trajectory, ranks[1][name].trajectory)


@pytest.fixture(scope="module")
@once_per_process
def stages_and_cp():
    cases = {f"flux_{schedule}": FLUX.but(schedule=schedule, pp=2, cp=2) for schedule in SCHEDULES}
    cases["wan_reweight"] = WAN.but(schedule="reweight", pp=2, cp=2)  # reference forwards and KL on the pieces
    return run_ranks(_run_all, 4, cases, timeout=500), _reference({k: c.but(cp=1) for k, c in cases.items()})


def test_pp2_cp2_equals_world_size_1(stages_and_cp):
    """pp=2 x cp=2 on 4 ranks: each stage's CP pair splits every sample's tokens; every schedule still runs on
    megatron's pipelined schedules, and each stage's gradients are the world-size-1 step's (1e-5)."""
    ranks, reference = stages_and_cp
    for name, ref in reference.items():
        calls = ranks[0]["pp_sizes"][name]
        assert {c[0] for c in calls if c[2]} == {2}, (name, calls)  # no lock-step rollout
        assert {c[0] for c in calls if not c[2]} == ({1} if "retain" in name else {2}), (name, calls)
        for out in (rank[name] for rank in ranks):
            expected, mine = _stage_grads(ref, out)
            assert rel_l2(expected, mine) <= 1e-5, name
            np.testing.assert_allclose(out.rewards, ref.rewards, rtol=1e-5, atol=1e-6)
            assert abs(out.losses[0] - ref.losses[0]) <= 1e-6, name
            assert out.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-5), name
        assert sorted(ranks[0][name].names + ranks[2][name].names) == sorted(ref.names), name
        # ranks 0 and 1 are the first stage's CP pair (different pieces of the same samples), rank 2 is the second
        # stage's CP rank 0 (the same pieces as rank 0)
        assert np.array_equal(ranks[0][name].trajectory, ranks[2][name].trajectory), name
        assert not np.array_equal(ranks[0][name].trajectory, ranks[1][name].trajectory), name


def _train(config: str, run: Path, *overrides: str) -> None:
    train_ranks("--config", config, f"train.output_dir={run}", *COMMON, *overrides)


def _flat(tensors: dict) -> torch.Tensor:
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors)])


@pytest.mark.parametrize("config", [TINY_FLUX, TINY_SD3, TINY_QWEN], ids=["flux", "sd3", "qwen_image"])
def test_pp2_checkpoint_resumes_at_pp1(tmp_path, config):
    from leangrpo_mcore.cli.train import main as train_main

    reference = tmp_path / "pp2"
    _train(config, reference, "parallel.pp=2")
    run = tmp_path / "pp1"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "step_3")
    assert train_main(["--config", config, f"train.output_dir={run}", *COMMON,
                       f"checkpoint.resume={run / 'checkpoints' / 'step_2'}"]) == 0
    saved = model_tensors(reference / "checkpoints" / "step_2")
    mine, ref = (model_tensors(r / "checkpoints" / "step_3") for r in (run, reference))
    assert sorted(mine) == sorted(ref) == sorted(saved)  # both stages' parameters in one checkpoint
    before, ref, mine = _flat(saved), _flat(ref), _flat(mine)
    assert float((mine - ref).norm() / ref.norm()) <= 1e-5
    update_ref, update_mine = ref - before, mine - before
    assert float(update_ref.norm()) > 0
    assert float(update_mine @ update_ref / (update_mine.norm() * update_ref.norm())) >= 0.999
