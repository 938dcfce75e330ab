"""``reward.async_scoring=true`` through the trainer: the same run as synchronous scoring, and the same stops.

The tiny FLUX config (two prompt groups per step) is trained with and without background scoring; the metrics
rows (times and resident memory aside), the sample grid and the checkpoint weights must be identical, for
Native, Retain and Reweight at world size 1 (through the remote reward on the example server, and through a
local reward with LoRA and KL). A reward that fails in the background stops the run with its one line, and
nothing of that step is logged or saved. (The two-rank case rides on the gloo runs of ``test_train_e2e``.)
"""

import contextlib
import importlib.util
import io
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.engine.throughput import TIMED_SCALARS
from leangrpo_mcore.rl.rewards import REWARDS, register_reward
from tests.ckpt_helpers import model_tensors, stored_tensors
from tests.distributed.launcher import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
LORA_KL = ("model.lora.rank=4", "model.lora.alpha=8", "grpo.kl_beta=0.05")

if "scorer_lost_for_async_tests" not in REWARDS:
    @register_reward("scorer_lost_for_async_tests")
    class _FailsAfter:
        """Mean intensity for ``calls`` batches, then a failure (on a later step)."""

        def __init__(self, calls: int = 4) -> None:
            self.calls, self.done = calls, 0

        def __call__(self, images, prompts):
            self.done += 1
            if self.done > self.calls:
                raise RuntimeError(f"scorer lost after {self.calls} batches")
            return images.mean(dim=(1, 2, 3))

def _server_tool():
    spec = importlib.util.spec_from_file_location("reward_server_example", ROOT / "tools" / "reward_server_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _serving(delay_s: float):
    server = _server_tool().make_server(0, delay_s=delay_s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "max_rss", *TIMED_SCALARS))} for r in rows]


def _run(run: Path, *overrides: str) -> tuple[int, list[str]]:
    """(exit code, the 'error:' lines) of one in-process run of the tiny FLUX config."""
    stream = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(stream):
            code = train_main(["--config", TINY, f"train.output_dir={run}", *overrides])
    finally:
        torch.set_num_threads(threads)
    return code, [line for line in stream.getvalue().splitlines() if line.startswith("error:")]


def _assert_same_run(sync: Path, background: Path, steps: int = 3) -> None:
    assert _rows(sync) == _rows(background) and len(_rows(sync)) == steps
    last = f"step_{steps}"
    assert (sync / "samples" / f"{last}.png").read_bytes() == (background / "samples" / f"{last}.png").read_bytes()
    for step in sorted({"step_2", last}):
        mine, ref = model_tensors(background / "checkpoints" / step), model_tensors(sync / "checkpoints" / step)
        assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    optim = [stored_tensors(r / "checkpoints" / last, "optim/") for r in (sync, background)]
    assert optim[0].keys() == optim[1].keys() and all(torch.equal(optim[0][k], optim[1][k]) for k in optim[0])


@pytest.mark.parametrize("schedule", ["native", "retain", "reweight"])
def test_remote_reward_in_the_background_trains_the_same_run(schedule, tmp_path):
    with _serving(delay_s=0.02) as url:
        remote = ("reward.name=remote", f"reward.url={url}", f"schedule.name={schedule}")
        assert _run(tmp_path / "sync", *remote) == (0, [])
        assert _run(tmp_path / "async", *remote, "reward.async_scoring=true") == (0, [])
    _assert_same_run(tmp_path / "sync", tmp_path / "async")


def test_local_reward_with_lora_and_kl_in_the_background_trains_the_same_run(tmp_path):
    assert _run(tmp_path / "sync", *LORA_KL) == (0, [])
    assert _run(tmp_path / "async", *LORA_KL, "reward.async_scoring=true") == (0, [])
    _assert_same_run(tmp_path / "sync", tmp_path / "async")


def test_a_background_reward_error_stops_the_run_before_the_step_is_saved(tmp_path):
    # Four batches per step (two groups of two generations): the fifth, in step 2, fails on the worker thread.
    code, errors = _run(tmp_path / "run", "reward.name=scorer_lost_for_async_tests", "reward.async_scoring=true",
                        "checkpoint.save_every=1")
    assert code == 2
    assert errors == ["error: reward 'scorer_lost_for_async_tests' raised RuntimeError: scorer lost after 4 batches"]
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_1"]
    # A server that is gone fails the first step the same way, through the remote reward's own submit.
    code, errors = _run(tmp_path / "gone", "reward.name=remote", f"reward.url=http://127.0.0.1:{free_port()}/",
                        "reward.retries=0", "reward.async_scoring=true")
    assert code == 2 and len(errors) == 1 and "unreachable after 1 attempts" in errors[0]
    assert not (tmp_path / "gone" / "metrics.jsonl").exists() or _rows(tmp_path / "gone") == []
    assert os.listdir(tmp_path / "gone" / "checkpoints") == []
