"""Pipeline stages on 2 gloo ranks (``parallel.pp=2``): what a stage holds after a pipelined call, and a loss
error on the last stage.

- A no-grad pipelined rollout call keeps none of the boundary tensors stage 0 sent (weak references to them die
  as the schedule moves on), and its peak does not grow with the call's micro-batches; under grad (Retain's
  kept graphs) every boundary stays alive until its velocity is tied to it, and the velocities are the no-grad
  call's, bit for bit. Megatron's 1F1B frees each sent boundary's data (``deallocate_pipeline_outputs``).
- A loss that raises on the last stage (a reward-like UserError in Native's 1F1B recompute, a ValueError in
  Reweight's) reaches the first stage as the same exception within seconds, and the CLI wrapper turns the
  UserError into exit code 2 with the same one line on both ranks.
"""

from __future__ import annotations

import gc
import json
import os
import time
import weakref

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

TINY = {"family": "flux", "preset": "flux-tiny", "num_layers": 2, "num_single_layers": 1}
GRID = 8  # latent grid: 4 x 4 = 16 packed image tokens


def _staged():
    from leangrpo_mcore.diffusion.velocity import FluxVelocity
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.models.common.pipeline import split_blocks
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context
    from leangrpo_mcore.parallel.stages import StagedVelocity, StageLink

    ctx = build_parallel_context(Layout(pp=2))
    policy = build_policy(TINY, seed=0, backend="local", stage=split_blocks(3, 2)[ctx.pp_rank])
    return StagedVelocity(FluxVelocity(policy, latent_height=GRID, latent_width=GRID), StageLink(ctx, torch.float32))


def _requests(staged, count: int) -> list:
    from leangrpo_mcore.diffusion.trajectory import Conditioning

    config = staged.policy.config
    gen = torch.Generator().manual_seed(1)
    cond = Conditioning(encoder_hidden_states=torch.randn(1, 5, config.joint_attention_dim, generator=gen),
                        pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=gen),
                        guidance=torch.full((1,), 3.5))
    return [(torch.randn(1, (GRID // 2) ** 2, config.in_channels, generator=gen), torch.full((1,), 0.4 + 0.1 * i),
             cond) for i in range(count)]


def _boundaries_rank(rank: int, world_size: int) -> dict:
    from leangrpo_mcore.parallel.memory import MemoryMeter
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    staged = _staged()
    sent: list = []
    alive_before: list = []  # per forward of this stage: how many earlier boundaries are still alive
    real = staged.boundary

    def boundary(*args):
        gc.collect()
        alive_before.append(sum(ref() is not None for ref in sent))
        out = real(*args)
        sent.append(weakref.ref(out))
        return out

    staged.boundary = boundary
    requests = _requests(staged, 4)
    with torch.no_grad():
        plain = staged.velocities(requests)
    gc.collect()
    no_grad = {"during": list(alive_before), "after": sum(ref() is not None for ref in sent)}
    sent.clear()
    alive_before.clear()
    kept = staged.velocities(requests)
    grad = {"during": list(alive_before), "graphs": sum(v.grad_fn is not None for v in kept)}
    same = all(torch.equal(a, b.detach()) for a, b in zip(plain, kept))
    del kept
    peaks = {}
    for count in (2, 6):
        more = _requests(staged, count)
        with torch.no_grad():
            staged.velocities(more)  # warm-up of this shape
            with MemoryMeter("cpu") as meter:
                staged.velocities(more)
        peaks[count] = meter.peak_bytes
    destroy_parallel_context()
    tokens = 1 + 5 + (GRID // 2) ** 2  # temb + text + image tokens
    return {"no_grad": no_grad, "grad": grad, "same": same, "peaks": peaks, "sent_sizes": _sent_sizes(),
            "boundary_bytes": 4 * tokens * staged.policy.config.hidden_size}


def _sent_sizes() -> dict:
    """Native's step at pp=2: the element counts of the boundaries this stage sent, by whether grad was on
    (its rollout: forward-only calls; its recompute: 1F1B, whose sent outputs megatron frees)."""
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context
    from leangrpo_mcore.parallel.stages import StagedVelocity
    from tests.unit.test_schedules_parity import Case, run_case

    real, sent = StagedVelocity.boundary, []

    def boundary(self, *args):
        out = real(self, *args)
        sent.append((torch.is_grad_enabled(), out))
        return out

    StagedVelocity.boundary = boundary
    try:
        run_case(Case(schedule="native", pp=2))
    finally:
        StagedVelocity.boundary = real
        destroy_parallel_context()
    return {grad: sorted({out.numel() for g, out in sent if g == grad}) for grad in (False, True)}


@pytest.mark.slow
def test_no_grad_rollout_keeps_no_boundary_and_grad_keeps_each():
    first, last = run_ranks(_boundaries_rank, 2, timeout=180)
    # without grad, stage 0 holds at most the one boundary megatron's loop still names while it runs the next
    # forward; under grad every earlier boundary stays until its velocity is tied to it
    assert first["no_grad"] == {"during": [0, 1, 1, 1], "after": 0}, first
    assert first["grad"] == {"during": [0, 1, 2, 3], "graphs": 4}, first
    assert last["no_grad"]["during"] == [] and last["grad"]["graphs"] == 4  # the last stage sends none
    assert first["same"] and last["same"]
    # megatron's 1F1B frees a sent boundary's data (a one-element stand-in stays for the backward); a
    # forward-only call leaves that to Python
    assert first["sent_sizes"][True] == [1] and min(first["sent_sizes"][False]) > 1, first
    # a call that kept its boundaries would peak 4 boundaries higher with 4 more micro-batches
    assert abs(first["peaks"][6] - first["peaks"][2]) < first["boundary_bytes"], first


def _failing(real, kind: type, call: int, raised: list):
    """``real`` that raises ``kind`` at its ``call``-th call (counting from 0), noting when."""
    calls = []

    def loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == call + 1:
            raised.append(time.time())
            raise kind("reward model returned NaN for prompt 3")
        return real(*args, **kwargs)

    return loss


def _loss_error_rank(rank: int, world_size: int, tmp: str) -> dict:
    from leangrpo_mcore.cli.common import run_main
    from leangrpo_mcore.errors import UserError
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context
    from leangrpo_mcore.schedules import native, reweight
    from tests.unit.test_schedules_parity import Case, run_case

    out, raised = {}, []
    if rank == 1:  # the last stage: the only one whose scheduler calls the loss
        native.unit_loss = _failing(native.unit_loss, UserError, 1, raised)
        reweight.unit_loss = _failing(reweight.unit_loss, ValueError, 0, raised)
    os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(tmp, f"error_{rank}.json")
    code = run_main(lambda argv: run_case(Case(schedule="native", pp=2)))
    out["native"] = {"code": code, "at": time.time()}
    with open(os.environ.pop("TORCHELASTIC_ERROR_FILE"), encoding="utf-8") as fp:
        out["native"]["line"] = json.load(fp)["message"]["message"]
    try:
        run_case(Case(schedule="reweight", pp=2))
    except ValueError as err:
        out["reweight"] = {"error": (type(err).__name__, str(err)), "at": time.time()}
    destroy_parallel_context()
    out["raised"] = raised
    return out


def test_a_loss_error_on_the_last_stage_reaches_every_stage_at_once(tmp_path):
    first, last = run_ranks(_loss_error_rank, 2, str(tmp_path), timeout=240)
    native_raised, reweight_raised = last["raised"]
    for rank in (first, last):
        assert rank["native"]["code"] == 2  # a UserError: the CLI's one line, exit 2, on both ranks
        assert rank["native"]["line"] == "reward model returned NaN for prompt 3"
        assert rank["reweight"]["error"] == ("ValueError", "reward model returned NaN for prompt 3")
        # the first stage learns of it in seconds, not at the process group's timeout
        assert rank["native"]["at"] - native_raised < 10, (rank, native_raised)
        assert rank["reweight"]["at"] - reweight_raised < 10, (rank, reweight_raised)
