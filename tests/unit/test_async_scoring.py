"""``reward.async_scoring``: a group is scored in the background while the next one rolls out, with the same numbers.

The step engine's results (rewards, trajectories, every update's gradient, the parameters after the optimizer
steps, losses, ratios, norms) must be bitwise equal to synchronous scoring for every schedule, with the
accumulations that cross groups (Reweight's KL accumulator, affine folds, global-std folds) included; the
scoring must really run while the next group rolls out; and the background paths of the reward wrapper must
keep the synchronous error contract.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from leangrpo_mcore.rl.rewards import RewardError, ValidatedReward, build_reward
from tests.unit.test_schedules_parity import (  # noqa: F401 -- _one_thread: the autouse fixture
    Case, _one_thread, _reward, bitwise, run_case)




def _slow_reward(final: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """The parity tests' reward, late enough that the engine really waits for it."""
    time.sleep(0.01)
    return _reward(final, prompt_ids)


def _assert_same(sync, background) -> None:
    assert np.array_equal(sync.rewards, background.rewards)
    assert np.array_equal(sync.trajectory, background.trajectory)
    assert len(sync.grads) == len(background.grads)
    assert all(bitwise(a, b) for a, b in zip(sync.grads, background.grads))
    assert bitwise(sync.params, background.params)
    assert sync.losses == background.losses and sync.ratio == background.ratio
    assert sync.grad_norms == background.grad_norms


CASES = {
    "flux": Case(family="flux"),
    # Two groups in one update, each with its own KL accumulator while the other waits.
    "flux_lora_kl_window": Case(family="flux", lora=True, kl_beta=50.0, selection="sde_window", window=2,
                                fraction=1.0, micro_batch=2),
    "flux_lora_kl_global_std": Case(family="flux", lora=True, kl_beta=50.0, selection="sde_window", window=2,
                                    fraction=1.0, global_std=True, micro_batch=2),
    "wan_kl_dance_two_updates": Case(family="wan", lora=True, kl_beta=20.0, kl_form="exact", selection="dance_grpo",
                                     fraction=0.7, advantage="dance_grpo", sde_kind="dance_grpo", updates=2,
                                     group_size=3, prompts=4),
    "wan_global_std_clamp": Case(family="wan", global_std=True, adv_clip_max=0.8),
}


@pytest.mark.parametrize("schedule", ["native", "retain", "reweight"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_async_scoring_is_bitwise_the_synchronous_step(name, schedule):
    case = CASES[name].but(schedule=schedule)
    _assert_same(run_case(case, _slow_reward), run_case(case.but(async_scoring=True), _slow_reward))


@pytest.mark.parametrize("case", [Case(family="flux", micro_batch=2, prompts=3),
                                  Case(family="flux", lora=True, kl_beta=50.0, selection="sde_window", window=2,
                                       fraction=1.0, global_std=True)], ids=["group_std", "global_std"])
def test_reweight_affine_folds_are_bitwise_the_synchronous_ones(case):
    case = case.but(schedule="reweight", accumulate="affine")
    _assert_same(run_case(case, _slow_reward), run_case(case.but(async_scoring=True), _slow_reward))


class _LoggingReward:
    """A reward with ``submit``: logs each submission and each join, scores on its own thread."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def _note(self, event: str, slot: int) -> None:
        with self.lock:
            self.log.append((event, slot))

    def __call__(self, final, prompt_ids):  # the synchronous path, unused here
        raise AssertionError("async scoring must submit")

    def submit(self, final, prompt_ids) -> Future:
        slot = int(prompt_ids[0])
        self._note("submit", slot)
        reward = self

        class Logged(Future):
            def result(self, timeout=None):
                reward._note("join", slot)
                return super().result(timeout)

        future = Logged()
        threading.Thread(target=lambda: future.set_result(_slow_reward(final, prompt_ids)), daemon=True).start()
        return future


def test_a_group_is_joined_only_after_the_next_group_rolled_out():
    reward = _LoggingReward()
    run_case(Case(family="flux", schedule="retain", prompts=3, group_size=2, async_scoring=True), reward)
    log = reward.log
    # Prompt p's ids are all p (run_case uses prompt_ids = arange): two micro-batches per group.
    first_join = {p: log.index(("join", p)) for p in range(3)}
    last_submit = {p: max(i for i, e in enumerate(log) if e == ("submit", p)) for p in range(3)}
    assert last_submit[1] < first_join[0] and last_submit[2] < first_join[1]  # scored during the next rollout
    assert first_join[0] < first_join[1] < first_join[2]  # joined in order, each before its update
    assert [e for e in log if e[0] == "submit"] == [("submit", p) for p in range(3) for _ in range(2)]


def test_background_errors_keep_the_synchronous_contract():
    def nan_reward(final, prompt_ids):
        out = _reward(final, prompt_ids)
        out[0] = float("nan")
        return out

    with pytest.raises(ValueError, match="reward_fn returned 1 non-finite rewards"):
        run_case(Case(family="flux", schedule="reweight", async_scoring=True), nan_reward)

    def broken(final, prompt_ids):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        run_case(Case(family="flux", schedule="native", async_scoring=True), broken)


def _images(batch=3):
    return torch.rand(batch, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_validated_reward_submit_runs_the_reward_on_a_worker_thread():
    seen = []

    def reward(images, prompts):
        seen.append(threading.current_thread().name)
        return images.mean(dim=(1, 2, 3))

    wrapped = ValidatedReward("mine", reward)
    images = _images()
    assert torch.equal(wrapped.submit(images, ["a", "b", "c"]).result(), wrapped(images, ["a", "b", "c"]))
    assert seen[0].startswith("reward-mine") and seen[1] == threading.current_thread().name
    wrapped.close()
    with pytest.raises(ValueError, match="prompts must be a list of 3"):
        wrapped.submit(images, ["a"])  # bad inputs fail at once, as a call does
    failing = ValidatedReward("boom", lambda images, prompts: 1 / 0)
    with pytest.raises(RewardError, match="reward 'boom' raised ZeroDivisionError: division by zero"):
        failing.submit(images, ["a", "b", "c"]).result()
    short = ValidatedReward("short", lambda images, prompts: torch.zeros(2))
    with pytest.raises(RewardError, match=r"reward 'short' returned shape \(2,\), expected \(3,\)"):
        short.submit(images, ["a", "b", "c"]).result()
    jpeg = build_reward("jpeg_compressibility")
    assert torch.equal(jpeg.submit(images, ["a", "b", "c"]).result(), jpeg(images, ["a", "b", "c"]))


class _OwnSubmit:
    """A reward with its own ``submit`` (as the remote one has): ValidatedReward must hand batches to it."""

    def __init__(self, values) -> None:
        self.values, self.submitted = values, 0

    def __call__(self, images, prompts):
        raise AssertionError("submit must be used")

    def submit(self, images, prompts) -> Future:
        self.submitted += 1
        future = Future()
        if isinstance(self.values, Exception):
            future.set_exception(self.values)
        else:
            future.set_result(self.values)
        return future


def test_validated_reward_submit_uses_the_rewards_own_submit():
    images = _images(2)
    own = _OwnSubmit(torch.tensor([1.0, 2.0], dtype=torch.float64))
    out = ValidatedReward("own", own).submit(images, ["a", "b"]).result()
    assert own.submitted == 1 and out.dtype == torch.float32 and out.tolist() == [1.0, 2.0]
    with pytest.raises(RewardError, match="reward 'own' returned 1 non-finite values"):
        ValidatedReward("own", _OwnSubmit(torch.tensor([1.0, float("inf")]))).submit(images, ["a", "b"]).result()
    with pytest.raises(RewardError, match="reward 'own' raised KeyError: 'x'"):
        ValidatedReward("own", _OwnSubmit(KeyError("x"))).submit(images, ["a", "b"]).result()
    remote_error = RewardError("reward server http://h/ unreachable after 1 attempts: boom")
    with pytest.raises(RewardError) as caught:
        ValidatedReward("remote", _OwnSubmit(remote_error)).submit(images, ["a", "b"]).result()
    assert caught.value is remote_error  # the remote reward's own line is kept as it is


def _server_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "reward_server_example.py"
    spec = importlib.util.spec_from_file_location("reward_server_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_server_delay_makes_every_batch_slow(capsys):
    tool = _server_tool()
    server = tool.make_server(0, delay_s=0.3)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        remote = build_reward("remote", url=f"http://127.0.0.1:{server.server_address[1]}/")
        images = _images(2)
        begin = time.perf_counter()
        assert torch.equal(remote(images, ["a", "b"]), build_reward("jpeg_compressibility")(images, ["a", "b"]))
        assert time.perf_counter() - begin >= 0.3
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as stop:
            tool.main(["--delay-s", bad, "--port", "0"])
        assert stop.value.code == 2 and "--delay-s must be a finite number >= 0" in capsys.readouterr().err


def test_bench_summary_table():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_async_scoring.py"
    spec = importlib.util.spec_from_file_location("bench_async_scoring", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    launch = lambda step: [{"time_step_s": 9.0}] + [{"time_step_s": step, "time_rollout_s": 0.1, "time_reward_s": 0.2}] * 3
    table = tool.summarize({"false": [launch(0.8)], "true": [launch(0.4)]})
    assert "| false | 3 | 0.800 | 0.100 | 0.200 |" in table and "0.800 s -> 0.400 s (2.00x)" in table
