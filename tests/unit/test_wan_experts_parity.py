"""Two experts under the three schedules (world size 1, fp32): Native, Retain and Reweight agree as they do on one
transformer (Retain bitwise, Reweight at the fp32 floor); a selected step's gradient reaches only the expert that
ran it; with ``experts.train: high`` the low-noise expert is bitwise unchanged and the high-noise one receives
exactly the gradient it receives when both train."""

import numpy as np
import pytest

from leangrpo_mcore.models import build_policy
from tests.unit.test_schedules_parity import Case, bitwise, check_parity, rel_l2, run_case, run_three

pytestmark = pytest.mark.slow

# flow_grpo selection trains steps 0-2 of 4; on the Wan schedule (shift 3) step 0 runs the high-noise expert
# (timestep 1000 >= 875), steps 1-3 the low-noise one (857, 667, 400)
EXPERTS = Case(family="wan", experts="both", max_grad_norm=0.0)
# DanceGRPO: one random step of steps 0-2 per sample, CFG, LoRA on both experts with the KL term
DANCE_LORA = EXPERTS.but(lora=True, kl_beta=20.0, selection="dance_grpo", fraction=0.5, advantage="dance_grpo",
                         sde_kind="dance_grpo", group_size=3)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _by_expert(outcome, update: int = 0) -> dict[str, float]:
    """The gradient norm each expert received."""
    norms = {"high": 0.0, "low": 0.0}
    for name, grad in zip(outcome.names, outcome.grads[update]):
        norms[name.split(".")[0]] += float((grad.astype(np.float64) ** 2).sum())
    return norms


def test_both_experts_train_and_the_schedules_agree():
    native, retain, reweight = run_three(EXPERTS)
    check_parity(native, retain, reweight)
    norms = _by_expert(native)
    assert norms["high"] > 0 and norms["low"] > 0


def test_training_only_the_high_noise_expert():
    both = run_case(EXPERTS)
    native, retain, reweight = run_three(EXPERTS.but(experts="high"))
    check_parity(native, retain, reweight)
    assert native.names and all(name.startswith("high.") for name in native.names)
    # the high-noise expert's gradient is the one it gets when both train: the low steps never reach it
    mine = dict(zip(both.names, both.grads[0]))
    assert bitwise(native.grads[0], [mine[name] for name in native.names])
    # the low-noise expert is bitwise the initial one
    initial = dict(build_policy({"family": "wan", "preset": "wan-tiny-a14b"}, seed=0, backend="local")
                   .named_parameters())
    assert sorted(native.frozen) == sorted(n for n in initial if n.startswith("low."))
    for out in (native, retain, reweight):
        assert all(np.array_equal(value, initial[name].detach().numpy()) for name, value in out.frozen.items())
    low = run_case(EXPERTS.but(experts="low"))
    assert bitwise(low.grads[0], [mine[name] for name in low.names])
    assert all(name.startswith("low.") for name in low.names)


def test_dance_selection_lora_kl_on_both_experts():
    native, retain, reweight = run_three(DANCE_LORA)
    check_parity(native, retain, reweight, tol=3e-6)
    norms = _by_expert(native)
    assert norms["high"] > 0 and norms["low"] > 0
    assert rel_l2(native.grads[0], run_case(DANCE_LORA.but(kl_beta=0.0)).grads[0]) > 1e-2
