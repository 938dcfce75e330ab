"""``parallel.timeout_minutes`` reaches every process group the project creates: megatron's, the DeviceMesh's,
the reward-gather groups and the checkpoint writer's; a rank stalled on a non-default group makes its peer fail
after that timeout instead of hanging for torch's 30 minutes."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(minutes=0.05)  # 3 s
STALL_S = 60.0


def _timeout_of(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _time_collective(group) -> tuple[float, str]:
    """Seconds until an all-reduce on ``group`` fails (its peer never joins), and the error's text."""
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as err:
        return time.monotonic() - began, str(err)
    return time.monotonic() - began, ""


def _groups_and_stall(rank: int, world: int, done: str) -> dict:
    from megatron.core import parallel_state

    from leangrpo_mcore.engine.launch import explain_timeout
    from leangrpo_mcore.parallel.groups import build_group_process_groups
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context

    ctx = build_parallel_context(Layout(tp=1), "cpu", timeout=TIMEOUT)
    gather = build_group_process_groups("shared", ctx.dp_size, 2, ctx.all_dp_global_ranks, timeout=TIMEOUT)
    timeouts = {
        "dp_shard mesh": _timeout_of(ctx.dp_shard_group()),
        "megatron dp": _timeout_of(parallel_state.get_data_parallel_group()),
        "megatron tp": _timeout_of(parallel_state.get_tensor_model_parallel_group()),
        "megatron dp gloo": _timeout_of(parallel_state.get_data_parallel_group_gloo()),
        "reward gather": _timeout_of(gather[(0, 1)]),
        "default": _timeout_of(dist.group.WORLD),
    }
    result = {"timeouts": timeouts}
    if rank == 0:
        result["mesh"] = _time_collective(ctx.dp_shard_group())
        result["gather"] = _time_collective(gather[(0, 1)])
        result["line"] = explain_timeout(RuntimeError(result["mesh"][1]), TIMEOUT.total_seconds())
        Path(done).touch()
    else:
        # rank 1 stalls: it never joins rank 0's collectives, and waits until rank 0 has timed both (or STALL_S)
        began = time.monotonic()
        while not Path(done).exists() and time.monotonic() - began < STALL_S:
            time.sleep(0.1)
    destroy_parallel_context()
    return result


def test_a_stalled_rank_fails_its_peer_within_the_timeout_on_every_group(tmp_path):
    results = run_ranks(_groups_and_stall, 2, str(tmp_path / "timed"), timeout=120)
    for r in results:
        # The harness's default group keeps torch's 30 minutes; every group built here has the 3 s.
        assert r["timeouts"]["default"] == timedelta(minutes=30)
        assert {k: v for k, v in r["timeouts"].items() if k != "default"} == {
            k: TIMEOUT for k in r["timeouts"] if k != "default"}
    for name in ("mesh", "gather"):
        seconds, message = results[0][name]
        assert message, f"{name}: the collective with a stalled peer did not fail"
        assert 2.5 <= seconds < 15.0, (name, seconds, message)  # 3 s, and a loaded machine's delay
    line = results[0]["line"]
    assert line.startswith("a collective waited 3 s (parallel.timeout_minutes=0.05) for a rank"), line


def _inherit(rank: int, world: int) -> dict:
    import os

    from megatron.core import parallel_state

    from leangrpo_mcore.engine.launch import init_distributed
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context

    # A lone process: init_distributed's own one-rank group, with the key's timeout; no explicit timeout below.
    dist.destroy_process_group()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    init_distributed(timeout_s=7.0)
    ctx = build_parallel_context(Layout(), "cpu")
    found = {"context": ctx.group_timeout, "default": _timeout_of(dist.group.WORLD),
             "megatron tp": _timeout_of(parallel_state.get_tensor_model_parallel_group())}
    destroy_parallel_context()
    return found


def test_groups_inherit_the_default_groups_timeout():
    (found,) = run_ranks(_inherit, 1, timeout=60)
    assert found == {k: timedelta(seconds=7) for k in found}


def test_only_a_collective_timeout_is_explained():
    from leangrpo_mcore.engine.launch import explain_timeout
    from leangrpo_mcore.rl.rewards.base import RewardError

    assert explain_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 60) is None
    assert explain_timeout(RewardError("remote: timed out after 60 s (reward.timeout_s)"), 60) is None
    line = explain_timeout(dist.DistBackendError("Watchdog caught collective operation timeout: timed out"), 90)
    assert line.startswith("a collective waited 90 s (parallel.timeout_minutes=1.5)"), line


def test_the_trainer_cli_ends_a_collective_timeout_in_one_line_naming_the_key(monkeypatch, capsys, tmp_path):
    from leangrpo_mcore.cli import train as train_cli
    from leangrpo_mcore.engine import trainer
    from tests.cli_helpers import run_cli

    def stalled(config):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "6000ms for recv operation to complete")

    monkeypatch.setattr(trainer, "train", stalled)
    config = str(Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny" / "flux.yaml")
    code, errors, out = run_cli(train_cli.main, capsys, "--config", config, "parallel.timeout_minutes=0.1",
                                f"train.output_dir={tmp_path / 'run'}")
    assert code == 124 and len(errors) == 1 and "Traceback" not in out, out
    assert errors[0].startswith("error: a collective waited 6 s (parallel.timeout_minutes=0.1) for a rank"), errors
