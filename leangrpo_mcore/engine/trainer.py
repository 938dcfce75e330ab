"""The training loop: build from the config, resume, run ``train.max_steps`` steps, log, checkpoint, summarise.

Robustness rules:

- bad input found while building (config values, paths, layouts, checkpoints) is a one-line
  :class:`~leangrpo_mcore.errors.UserError` on every rank;
- a reward that fails or returns NaN/inf on any rank stops every rank after the step with that reward's
  one-line error, before anything of that step is logged or saved;
- an update whose gradient is non-finite on any rank is skipped (the optimizer sees no gradient, so neither
  the weights nor the optimizer state change) and logged; ``train.max_nonfinite_skips`` consecutive skips stop
  the run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import resource
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from leangrpo_mcore.config import Config, config_to_yaml
from leangrpo_mcore.config.drift import PROMPTS_CONTENT, config_changes, record_launch_config, refusal
from leangrpo_mcore.data.vae import PACKED_FAMILIES, DecodedImages
from leangrpo_mcore.engine import build, checkpoint
from leangrpo_mcore.engine.launch import (DistContext, collective_device, first_error, get_logger, init_distributed,
                                          raise_if_any, shutdown)
from leangrpo_mcore.engine.metrics import MetricsLogger, ProgressBar, reward_stats
from leangrpo_mcore.engine.preemption import (PreemptionFlag, exit_code, set_aside_interrupted, signal_name,
                                              write_marker)
from leangrpo_mcore.engine.run_lock import lock_run_dir
from leangrpo_mcore.engine.run_dir import RunDir, append_jsonl, check_fresh_run, prepare, read_metrics
from leangrpo_mcore.engine.samples import save_grid, to_uint8, video_to_uint8
from leangrpo_mcore.engine.evaluate import Evaluator, eval_rewards, reward_input, write_eval_grid
from leangrpo_mcore.engine.step import StepInputs, StepResult
from leangrpo_mcore.engine.throughput import step_throughput
from leangrpo_mcore.engine.video import require_video_extra, write_video_grid
from leangrpo_mcore.engine.wandb_log import open_wandb
from leangrpo_mcore.engine.watchdog import StepWatchdog
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.mesh import destroy_parallel_context
from leangrpo_mcore.parallel.precision import fp8_precision
from leangrpo_mcore.rl.rewards import RewardError
from leangrpo_mcore.rl.rewards.base import flatten_videos

SAMPLE_GRID_MAX = 16
"""At most this many generations appear in a sample grid."""


def _sample_order(item: tuple) -> tuple:
    """Sample grids list the generations by prompt id, then prompt text."""
    return item[3], item[1]


class TrainingStopped(UserError):
    """The run stopped itself (repeated non-finite updates); reported as one line, exit code 2."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the project's bad-input errors (ValueError with a one-line message, RewardError) into UserError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, RewardError) as err:
        lines = str(err).strip().splitlines()
        raise UserError(lines[0] if lines else type(err).__name__) from err


class NonFiniteGuard:
    """An optimizer pre-step hook: if any rank holds a non-finite gradient, drop every gradient (skip the update)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.skipped = 0
        self._handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flag = torch.zeros(1, device=collective_device())
        if local:
            # One flag for all gradients: a single host sync instead of one per tensor.
            finite = torch.stack([torch.isfinite(g).all() for g in local]).all()
            flag += (~finite).to(flag.device, torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            self.skipped += 1


class RewardBridge:
    """The step engine's ``reward_fn``: decode latents, score them, keep sample images, capture reward errors.

    The reward sees the decoded images, or a video policy's videos, of which it scores the frames that
    ``reward.options.frames`` names (the first by default). A captured sample keeps its image as
    uint8 and, for a video policy (``sampler.frames > 1``), its whole video as uint8 too.

    :meth:`submit` does the same in the background (``reward.async_scoring``): one worker thread decodes the
    batches in submission order and hands each to the reward's ``submit``, so that a remote reward's requests
    are in flight while the next batch decodes. Errors and sample images are kept in submission order, so a
    step reports what a synchronous one would.

    With ``reward.aggregate: advantages`` it returns the (B, K) component rewards of the weighted reward (scored on
    the decoding thread in the background) and captions the samples with their weighted sum.
    """

    def __init__(self, data: build.DataParts, config: Config) -> None:
        self.data = data
        self.family = config.model.family
        self.height, self.width = config.sampler.height, config.sampler.width
        self.keep_video = config.sampler.frames > 1
        if self.keep_video:
            require_video_extra()  # on every rank before training, not on rank 0 at the first sample step
        # build._reward allows aggregate=advantages only with the weighted reward, wrapped in a ValidatedReward
        self.weighted = data.reward.fn if config.reward.aggregate == "advantages" and data.reward is not None else None
        self.error: Optional[str] = None
        self.capture = False
        self.watchdog: Optional[StepWatchdog] = None
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self.begin_step(False)

    def begin_step(self, capture: bool) -> None:
        """Reset the per-step state; ``capture`` keeps this step's images for a sample grid."""
        with self._lock:
            self.error, self.capture = None, capture
            self._error_at: Optional[int] = None
            self._samples: dict[int, list] = {}
            self._calls = 0

    @property
    def samples(self) -> list[tuple]:
        """(image, prompt, reward, prompt id, video) of this step's captured generations, in call order: the
        image (H, W, 3) uint8, the video (F, H, W, 3) uint8 or None (image policies)."""
        with self._lock:
            return [item for index in sorted(self._samples) for item in self._samples[index]]

    def _next_call(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls

    def _failed(self, index: int, message: str) -> None:
        """Keep the error of the earliest failing call (the one a synchronous step would stop at)."""
        with self._lock:
            if self._error_at is None or index < self._error_at:
                self.error, self._error_at = message, index

    def _decode(self, final_latents: torch.Tensor) -> DecodedImages:
        size = {"height": self.height, "width": self.width} if self.family in PACKED_FAMILIES else {}
        return self.data.decoder.decode(final_latents, **size)

    def _keep(self, index: int, decoded: DecodedImages, prompts: list, rewards: torch.Tensor,
              prompt_ids: torch.Tensor) -> None:
        if self.capture:
            videos = ([None] * len(prompts) if not self.keep_video or decoded.video is None
                      else list(video_to_uint8(decoded.video)))
            items = list(zip(to_uint8(decoded.images), prompts, rewards.tolist(), prompt_ids.tolist(), videos))
            with self._lock:
                self._samples[index] = items

    def _zeros(self, batch: int) -> torch.Tensor:
        """What a failed batch returns: zeros shaped as its rewards."""
        return torch.zeros(batch, len(self.weighted.weights)) if self.weighted is not None else torch.zeros(batch)

    def _components(self, images: torch.Tensor, prompts: list, metadata: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted reward's (B, K) components and their weighted sum (B,); videos are scored on the frames that
        ``reward.options.frames`` names, averaged per video, as the reward's own call scores them."""
        flat, flat_prompts, k = flatten_videos(images, prompts, self.data.reward.frames)
        components, total = self.weighted.scored_components(flat, flat_prompts,
                                                            [row for row in metadata for _ in range(k)])
        batch = images.shape[0]
        return components.view(batch, k, -1).mean(dim=1), total.view(batch, k).mean(dim=1)

    def _split(self, scored) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards for the engine, rewards for the captions) of a scoring result."""
        return scored if self.weighted is not None else (scored, scored)

    def __call__(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        """(B,) rewards ((B, K) component rewards) of ``final_latents``; zeros after a reward error (the step is
        then abandoned). The step watchdog sees the call as the phase "reward"."""
        if self.watchdog is None:
            return self._score(final_latents, prompt_ids)
        self.watchdog.enter("reward")
        try:
            return self._score(final_latents, prompt_ids)
        finally:
            self.watchdog.enter("rollout and update")

    def _score(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = [int(i) for i in prompt_ids.tolist()]
        prompts, metadata = self.data.dataset.get(ids), self.data.dataset.metadata(ids)
        index = self._next_call()
        if self.error is not None:
            return self._zeros(len(prompts))
        decoded = self._decode(final_latents)
        images = reward_input(decoded)
        try:
            rewards, shown = self._split(self._components(images, prompts, metadata) if self.weighted is not None
                                         else self.data.reward(images, prompts, metadata))
        except RewardError as err:
            self._failed(index, str(err))
            return self._zeros(len(prompts))
        self._keep(index, decoded, prompts, shown, prompt_ids)
        return rewards

    def submit(self, final_latents: torch.Tensor, prompt_ids: torch.Tensor) -> "Future[torch.Tensor]":
        """A Future of what calling the bridge returns; decoding and scoring run in the background.

        ``final_latents`` must not change until the Future is done. A reward error resolves the Future to
        zeros and sets :attr:`error` (as a call does); any other failure is the Future's exception.
        """
        ids = [int(i) for i in prompt_ids.tolist()]
        prompts, metadata = self.data.dataset.get(ids), self.data.dataset.metadata(ids)
        index = self._next_call()
        outer: Future = Future()
        if self.error is not None:
            outer.set_result(self._zeros(len(prompts)))
            return outer
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-decode")
            executor = self._executor
        stream = torch.cuda.current_stream(final_latents.device) if final_latents.is_cuda else None

        def settle(decoded: Optional[DecodedImages], done: Future) -> None:
            try:
                rewards, shown = self._split(done.result())
            except RewardError as err:
                self._failed(index, str(err))
                outer.set_result(self._zeros(len(prompts)))
                return
            except BaseException as exc:  # noqa: BLE001 -- the engine re-raises it where it joins the Future
                outer.set_exception(exc)
                return
            try:
                self._keep(index, decoded, prompts, shown, prompt_ids)
            except BaseException as exc:  # noqa: BLE001
                outer.set_exception(exc)
                return
            outer.set_result(rewards)

        def decode_and_score() -> None:
            try:
                # The worker decodes on the caller's device and stream, after the rollout that made the latents.
                device = contextlib.nullcontext() if stream is None else torch.cuda.device(final_latents.device)
                with device, (contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)):
                    decoded = self._decode(final_latents)
                    images = reward_input(decoded)
                    submit = None if self.weighted is not None else getattr(self.data.reward, "submit", None)
                    if callable(submit):
                        scoring = submit(images, prompts, metadata)
                    elif self.weighted is not None:  # the components, each validated, scored here
                        scoring = Future()
                        scoring.set_result(self._components(images, prompts, metadata))
                    else:  # a bare reward callable: score it here, on the decoding thread
                        scoring = Future()
                        scoring.set_result(self.data.reward(images, prompts, metadata))
            except RewardError as err:
                scoring = Future()
                scoring.set_exception(err)
                decoded = None
            except BaseException as exc:  # noqa: BLE001
                outer.set_exception(exc)
                return
            scoring.add_done_callback(lambda done: settle(decoded, done))

        executor.submit(decode_and_score)
        return outer

    def close(self) -> None:
        """Stop the background threads (after what was submitted), the reward's included."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        close = getattr(self.data.reward, "close", None)
        if callable(close):
            close()


@dataclass
class LoopState:
    """Counters that survive a resume."""

    step: int = 0
    """Last completed step."""
    nonfinite_streak: int = 0
    """Consecutive skipped updates up to ``step``."""
    step_times: list[float] = field(default_factory=list)
    """Wall-clock seconds of each step of this launch (not saved)."""
    stopped_by_signal: int = 0
    """The signal that stopped this launch after a preemption save (0: it ran to the end)."""


class Trainer:
    """One training run on this rank (see module docstring)."""

    def __init__(self, config: Config, dist_ctx: DistContext, logger: logging.Logger) -> None:
        self.dist, self.log = dist_ctx, logger
        build.check_precision(config)  # a contradiction in the dtypes is an error before any planning
        self.planned = frozenset(build.auto_keys(config))
        """The keys the user left auto: the planner's resolution of them may differ between launches."""
        self.config = config = build.resolve_plan(config, dist_ctx, logger)
        self.schedule = config.schedule.name
        self.run_dir = RunDir(config.train.output_dir)
        self.resume_path = self._resume_target()
        self.pctx = build.build_context(config, dist_ctx)
        build.check_layout_early(config, self.pctx)
        self.precision = build.precision_of(config, self.pctx)
        if self.precision.legacy_note:
            logger.info("%s", self.precision.legacy_note)
        self.source = build.resolve_model_source(config)  # model.path is read here, once
        self.family, self.hyper, self.lora = self.source.family, self.source.hyper, self.source.lora
        same_layout = self._check_compatible(self.resume_path) if self.resume_path else True
        self.data = build.build_data_parts(config, self.family, self.hyper, dist_ctx.device, self.pctx)
        self.parts = build.build_policy_parts(config, self.pctx, self.precision, source=self.source)
        self.bridge = RewardBridge(self.data, config)
        self.engine = build.build_engine(config, self.schedule, self.parts, self.pctx, self.bridge)
        if self.schedule == "reweight":
            plan = self.engine.plan.reweight_plan()
            logger.info("Reweight accumulates %s provisional gradients (in %s)%s%s", plan.accumulate,
                        plan.provisional_dtype or "the gradient dtype",
                        ", folding each group and scaling once by the global std" if plan.global_fold else "",
                        f"; {plan.note}" if plan.note else "")
        self.throughput = step_throughput(config, self.schedule, dist_ctx.world_size, dist_ctx.device)
        logger.info("%s", self.throughput.describe())
        self.evaluator = self._evaluator()
        self.guard = NonFiniteGuard(self.parts.optimizer)
        self.state = LoopState()
        self.resumed_step: Optional[int] = None
        self.pending: Optional[checkpoint.PendingSave] = None
        self.watchdog: Optional[StepWatchdog] = None
        if self.resume_path is not None:
            self._resume(self.resume_path, same_layout)
        self.config_yaml = config_to_yaml(config)
        first_error(prepare, self.run_dir, self.config_yaml, resume_step=self.state.step or None)
        first_error(record_launch_config, self.run_dir.root, self.state.step, self.config_yaml)
        enabled = dist_ctx.is_main
        wandb = open_wandb(config, self.run_dir.root, resumed=self.resume_path is not None, enabled=enabled)
        self.io_failure: Optional[str] = None
        with self._recording():
            self.metrics = MetricsLogger(self.run_dir.metrics_path,
                                         self.run_dir.tensorboard_dir if config.logging.tensorboard else None,
                                         enabled=enabled, purge_step=self.state.step + 1, wandb=wandb)
        raise_if_any(self.io_failure)
        self.progress = ProgressBar(config.train.max_steps, self.state.step,
                                    enabled=enabled and config.logging.progress_bar)
        self.engine.progress = self.progress.rollout_hook

    def _evaluator(self) -> Optional[Evaluator]:
        """The run's evaluator when ``eval.every`` or ``eval.before_train`` asks for one (its rewards only on the
        ranks that score)."""
        cfg = self.config
        if cfg.eval.every == 0 and not cfg.eval.before_train:
            return None
        rewards = build.scoring_reward(lambda: eval_rewards(cfg, self.data.reward), self.pctx)
        forward = fp8_precision(self.parts.policy) if cfg.model.fp8 else None
        return Evaluator(cfg, parts=self.parts, pctx=self.pctx, text_encoder=self.data.text_encoder,
                         decoder=self.data.decoder, rewards=rewards, forward_context=forward)

    def _resume_target(self) -> Optional[str]:
        """Collective: the checkpoint to resume (every rank verifies its share of it), or None after rank 0 has
        checked that a fresh run may start in the directory."""
        spec = self.config.checkpoint.resume
        path = checkpoint.resolve_resume(spec, self.run_dir, warn=self.log.warning)
        first_error(self._prepare_fresh, spec, path)
        return path

    def _prepare_fresh(self, spec: Optional[str], path: Optional[str]) -> None:
        if path is None and spec == "auto":
            # A launch stopped before its first checkpoint (preempted, killed) leaves metrics only: auto starts
            # afresh instead of refusing them, and keeps them aside.
            for old, new in set_aside_interrupted(self.run_dir):
                self.log.warning("checkpoint.resume=auto: no checkpoint to resume in %s, starting afresh; the "
                                 "interrupted launch's %s is kept as %s", self.run_dir.root,
                                 os.path.basename(old), os.path.basename(new))
        if path is None:
            check_fresh_run(self.run_dir, overwrite=self.config.train.overwrite)

    def _layout_record(self) -> dict:
        layout = self.pctx.layout
        record = {"world_size": self.dist.world_size, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
                  "dp_shard": int(layout.dp_shard), "dp_replicate": int(layout.dp_replicate),
                  "family": self.family.name, "model_config": self.hyper,
                  "lora": self.lora, "optimizer": self.config.optim.name, "schedule": self.schedule}
        # Through JSON, as trainer_state.json stores it (tuples become lists), so that records compare equal.
        return json.loads(json.dumps(record))

    def _check_compatible(self, path: str) -> bool:
        """UserError unless the checkpoint trains the same model; False when it was written at another layout."""
        saved = checkpoint.read_state(path)
        mine = self._layout_record()
        for key in ("family", "model_config", "lora", "optimizer"):
            if saved.get(key) != mine[key]:
                raise UserError(f"checkpoint {path} is incompatible with this config: its {key} is "
                                f"{saved.get(key)!r}, this run has {mine[key]!r}")
        # Checkpoints written before context or pipeline parallelism existed ran at cp = pp = 1.
        same = all(saved.get(k, 1 if k in ("cp", "pp") else None) == mine[k]
                   for k in ("world_size", "tp", "cp", "pp", "dp_shard", "dp_replicate"))
        if not same:
            self.log.info("resharding checkpoint written at world size %s (tp %s) to world size %s (tp %s); "
                          "per-rank RNG states are not restored", saved.get("world_size"), saved.get("tp"),
                          mine["world_size"], mine["tp"])
        return same

    def _resume(self, path: str, same: bool) -> None:
        p = self.parts
        data_changed = self._log_changed_settings(path)
        state = checkpoint.load_checkpoint(path, model=p.policy, optimizer=p.optimizer, lr_scheduler=p.lr_scheduler,
                                           ema=p.ema, layout=p.tp_layout, same_layout=same, warn=self.log.warning)
        if data_changed:
            # Another dataset (allowed by train.allow_config_change): the old position means nothing in it.
            self.log.info("resume: the prompt order restarts at epoch 0 of the changed prompt data")
        else:
            self.data.sampler.load_state_dict(state["sampler"])
        self.state.step = int(state["step"])
        self.state.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.resumed_step = self.state.step
        self.log.info("resumed from %s at step %d", path, self.state.step)

    @functools.cached_property
    def prompts_fingerprint(self) -> str:
        """The training prompts' :meth:`~leangrpo_mcore.data.prompts.PromptDataset.fingerprint` (kept in each
        checkpoint, compared on resume)."""
        return self.data.dataset.fingerprint()

    def _log_changed_settings(self, path: str) -> bool:
        """Compare every key with the checkpoint's config: one log line per change that keeps the steps as they
        were (this run's value applies); UserError naming every key that changes what a step computes, unless
        ``train.allow_config_change``. Returns whether the prompt data changed."""
        saved = checkpoint.saved_config(path)
        if saved is None:
            self.log.warning("resume: %s holds no readable config.yaml; the config is not compared", path)
            return False
        changes = config_changes(saved, self.config, saved_fingerprint=checkpoint.read_state(path).get(
            "prompts_fingerprint"), fingerprint=self.prompts_fingerprint, planned=self.planned)
        refused = [c for c in changes if not c.applied]
        if refused and not self.config.train.allow_config_change:
            raise UserError(refusal(path, refused))
        for change in changes:
            note = ("the new value applies" if change.applied else
                    "applied (train.allow_config_change=true): steps from here differ from the uninterrupted run")
            self.log.info("resume: %s changed from %r to %r; %s", change.key, change.before, change.after, note)
        return any(c.key in (PROMPTS_CONTENT, "data.shuffle", "train.seed") for c in refused)

    def run(self) -> LoopState:
        """Train until ``train.max_steps`` or a preemption signal (see :meth:`_stop_on_signal`); returns the
        final counters."""
        cfg = self.config
        signals = PreemptionFlag(cfg.train.save_on_signal)
        self.watchdog = self._start_watchdog()
        self.bridge.watchdog = self.watchdog
        try:
            if cfg.eval.before_train and self.state.step == 0:
                self._evaluate(0)
            for step in range(self.state.step + 1, cfg.train.max_steps + 1):
                self._train_step(step)
                self._phase("signal check")
                signum = signals.agreed()
                if signum and step < cfg.train.max_steps:  # after the last step the run ends as usual
                    self._stop_on_signal(step, signum)
                    break
                if self._save_due(step):
                    self._save(step)
                if cfg.eval.every and step % cfg.eval.every == 0:
                    self._evaluate(step)
            self._phase("checkpoint save")
            self._finish_save()
        finally:
            signals.restore()
            if self.watchdog is not None:
                self.watchdog.close()
            self.bridge.close()
            self.metrics.close()
            self.progress.close()
        if not self.state.stopped_by_signal:
            self._summary()
        return self.state

    def _start_watchdog(self) -> Optional[StepWatchdog]:
        minutes = self.config.train.step_timeout_minutes
        if minutes <= 0:
            return None
        return StepWatchdog(minutes * 60.0, self.dist.rank, self.dist.world_size,
                            setting=f"train.step_timeout_minutes={minutes:g}")

    def _phase(self, name: str, step: Optional[int] = None) -> None:
        """Tell the step watchdog (if any) what this rank does now."""
        if self.watchdog is not None:
            self.watchdog.enter(name, step)

    def _stop_on_signal(self, step: int, signum: int) -> None:
        """Save ``step`` synchronously (whatever checkpoint.async_save says), log one line, mark the stop."""
        path = self._save(step, sync=True)
        self.state.stopped_by_signal = signum
        if self.dist.is_main:
            write_marker(step, signum, path)
        self.log.info("%s: stopped after step %d with checkpoint %s; exit code %d (continue with "
                      "checkpoint.resume=auto)", signal_name(signum), step, path, exit_code(signum))

    def _sample_due(self, step: int) -> bool:
        every = self.config.logging.sample_every
        return step == self.config.train.max_steps or (every > 0 and step % every == 0)

    def _save_due(self, step: int) -> bool:
        every = self.config.checkpoint.save_every
        return step == self.config.train.max_steps or (every > 0 and step % every == 0)

    def _train_step(self, step: int) -> None:
        self._phase("text encoding", step)
        prompt_ids = self.data.sampler.next_indices()
        start = time.perf_counter()
        conditioning = self.data.text_encoder.encode(self.data.dataset.get(prompt_ids))
        self.bridge.begin_step(capture=self._sample_due(step))
        skipped_before = self.guard.skipped
        lr = float(self.parts.optimizer.param_groups[0]["lr"])
        self._phase("rollout and update")
        result = self.engine.step(StepInputs(step=step, conditioning=conditioning,
                                             prompt_ids=torch.tensor(prompt_ids, dtype=torch.long)))
        raise_if_any(self.bridge.error)
        self._phase("metrics and samples")
        elapsed = time.perf_counter() - start
        skipped = self.guard.skipped > skipped_before
        self._after_update(step, skipped)
        row = self._row(result, elapsed, skipped, lr, text_tokens=conditioning.encoder_hidden_states.shape[1])
        with self._recording():
            self.metrics.log(step, row)
        self.progress.update(step, row)
        if self.bridge.capture:
            self._write_samples(step)
        self._stop_on_io_failure(step, save_due=self._save_due(step))
        self._poll_save()
        self._stop_if_diverged(step)

    def _after_update(self, step: int, skipped: bool) -> None:
        self.state.step = step
        self.state.nonfinite_streak = self.state.nonfinite_streak + 1 if skipped else 0
        if skipped:
            self.log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)", step,
                             self.state.nonfinite_streak)
        elif self.parts.ema is not None:
            decay = self.config.train.ema_decay
            params = dict(self.parts.policy.named_parameters())
            with torch.no_grad():
                for name, shadow in self.parts.ema.items():
                    shadow.lerp_(params[name].detach().float(), 1.0 - decay)

    def _row(self, result: StepResult, elapsed: float, skipped: bool, lr: float, *, text_tokens: int) -> dict:
        components = None
        if result.component_rewards is not None:
            names = list(self.config.reward.weights or {})
            components = {name: result.component_rewards[..., k] for k, name in enumerate(names)}
        stats = reward_stats(result.rewards, components)
        self.state.step_times.append(elapsed)
        updates = result.updates
        row = {**stats, "loss": sum(u.loss for u in updates) / len(updates),
               "advantage_abs_mean": float(result.advantages.double().abs().mean()),
               "grad_norm": updates[-1].grad_norm, "clip_fraction": sum(u.clip_fraction for u in updates) / len(updates),
               "ratio_min": min(u.ratio_min for u in updates), "ratio_max": max(u.ratio_max for u in updates),
               "ratio_mean": sum(u.ratio_mean for u in updates) / len(updates),
               "lr": lr, "skipped": int(skipped),
               "nonfinite_streak": self.state.nonfinite_streak, "time_step_s": elapsed}
        row.update(self.throughput.scalars(elapsed, text_tokens))
        row.update({f"time_{phase}_s": seconds for phase, seconds in sorted(result.timings.items())})
        if result.window_start is not None:
            row["sde_window_start"] = result.window_start
        if result.peak_memory_bytes is not None:
            row["peak_memory_bytes"] = int(result.peak_memory_bytes)
        # ru_maxrss is in kB on Linux: the process's peak resident memory so far (CPU runs have no allocator peak).
        row["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return row

    def _write_samples(self, step: int) -> None:
        """samples/step_<N>.png (first frames) and, for a video policy, samples/step_<N>.mp4 (rank 0)."""
        # The grid shows the first SAMPLE_GRID_MAX in this order: no rank needs to send more than that.
        local = sorted(self.bridge.samples, key=_sample_order)[:SAMPLE_GRID_MAX]
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        if not self.dist.is_main or self.io_failure is not None:
            return
        items = sorted((item for part in gathered for item in part), key=_sample_order)[:SAMPLE_GRID_MAX]
        if not items:
            return
        prompts, rewards = [it[1] for it in items], [it[2] for it in items]
        images = torch.stack([torch.from_numpy(it[0]).permute(2, 0, 1) for it in items]).float() / 255.0
        with self._recording():
            grid = save_grid(self.run_dir.sample_path(step), images, prompts, rewards)
            self.metrics.add_image("samples", np.asarray(grid), step)
            if all(it[4] is not None for it in items):
                path, fps = self.run_dir.video_path(step), self.config.logging.video_fps
                write_video_grid(path, np.stack([it[4] for it in items]), prompts, rewards, fps=fps)
                self.metrics.add_video("samples_video", path, step, fps)

    def _evaluate(self, step: int) -> None:
        """Evaluate the current weights: ``eval.jsonl``, ``eval/`` scalars and the eval grid (first rank)."""
        self._phase("evaluation")
        with user_errors():
            result = self.evaluator.evaluate(step)
        if result is not None:  # the first rank's: it writes
            with self._recording():
                append_jsonl(self.run_dir.eval_path, result.to_json())
                self.metrics.log_scalars(step, result.scalars())
            self.log.info("eval at step %d: %s (%d prompts x %d, %.1f s)", step,
                          ", ".join(f"{name} {stats['mean']:.4f}" for name, stats in result.rewards.items()),
                          result.num_prompts, result.samples_per_prompt, result.time_s)
            if result.samples and self.io_failure is None:
                with self._recording():
                    write_eval_grid(self.run_dir, step, result.samples, self.metrics,
                                    fps=self.config.logging.video_fps)
        self._stop_on_io_failure(step, save_due=False)  # the step's checkpoint was written before the evaluation

    def _stop_if_diverged(self, step: int) -> None:
        if self.resumed_step is not None and step == self.resumed_step + 1 and self.state.nonfinite_streak:
            raise TrainingStopped(f"step {step}, the first after resuming from step {self.resumed_step}, has a "
                                  f"non-finite loss or gradient; the checkpoint does not train")
        limit = max(self.config.train.max_nonfinite_skips, 1)
        if self.state.nonfinite_streak >= limit:
            raise TrainingStopped(f"stopping at step {step}: {self.state.nonfinite_streak} consecutive updates had a "
                                  f"non-finite loss or gradient (train.max_nonfinite_skips="
                                  f"{self.config.train.max_nonfinite_skips}); lower optim.lr or check the reward")

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """Keep the first failed write of the run directory's files (a UserError: metrics, samples, TensorBoard,
        wandb, eval.jsonl) for :meth:`_stop_on_io_failure`: only rank 0 writes them, and every rank must stop."""
        try:
            yield
        except UserError as err:
            self.io_failure = self.io_failure or str(err)

    def _stop_on_io_failure(self, step: int, *, save_due: bool) -> None:
        """Collective: after a failed write on rank 0, stop every rank with its one line. The step's training is
        done: its checkpoint, when ``save_due``, is written first (synchronously), and a background write is
        waited for; the line says how that went."""
        try:
            raise_if_any(self.io_failure)
            return
        except UserError as err:
            failure = str(err)
        try:
            if save_due:
                self._save(step, sync=True)
                failure += f"; the checkpoint of step {step} was saved"
            else:
                self._finish_save()
        except UserError as err:
            failure += f"; the checkpoint was not saved either ({err})"
        raise UserError(failure)

    def _save(self, step: int, sync: bool = False) -> str:
        """Write the checkpoint of ``step``: published before this returns, or with ``checkpoint.async_save``
        (unless ``sync``) by a background thread as soon as its files are written; returns its final path."""
        self._phase("checkpoint save")
        self._finish_save()
        p = self.parts
        record = {**self._layout_record(), "sampler": self.data.sampler.state_dict(),
                  "nonfinite_streak": self.state.nonfinite_streak, "prompts_fingerprint": self.prompts_fingerprint}
        background = self.config.checkpoint.async_save and not sync
        self.pending = checkpoint.save_checkpoint(self.run_dir, step, model=p.policy, optimizer=p.optimizer,
                                                  lr_scheduler=p.lr_scheduler, ema=p.ema, layout=p.tp_layout,
                                                  state=record, config_yaml=self.config_yaml,
                                                  async_save=background)
        if not background:
            self._finish_save()
        return self.run_dir.checkpoint_path(step)

    def _poll_save(self) -> None:
        """Collective: report a background write once it is done on every rank (a failed one stops the run with
        its one line at the first step after it failed); nothing while it runs."""
        pending = self.pending
        if pending is None or pending.future is None:
            return
        try:
            path = pending.poll()
        except UserError:
            self.pending = None
            raise
        if path is not None:
            self.pending = None
            self._published(path)

    def _finish_save(self) -> None:
        """Wait for the checkpoint being written (publishing a synchronous one), then prune."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._published(pending.finish())

    def _published(self, path: str) -> None:
        if self.dist.is_main:
            for gone in checkpoint.prune(self.run_dir, self.config.checkpoint.keep_last, newest=path):
                self.log.info("removed old checkpoint %s", gone)
        self.log.info("saved checkpoint %s", path)

    def _summary(self) -> None:
        if not self.dist.is_main:
            return
        rows = read_metrics(self.run_dir.metrics_path)
        rewards = [r["reward_mean"] for r in rows if isinstance(r.get("reward_mean"), (int, float))]
        times = self.state.step_times
        lines = [f"finished {self.state.step} / {self.config.train.max_steps} steps ({self.schedule} schedule, "
                 f"world size {self.dist.world_size})"]
        if rewards:
            lines.append(f"reward: first {rewards[0]:.4f} -> last {rewards[-1]:.4f} "
                         f"(change {rewards[-1] - rewards[0]:+.4f})")
        if times:
            lines.append(f"mean step time: {sum(times) / len(times):.2f} s over {len(times)} steps this launch")
        complete = checkpoint.list_complete(self.run_dir)
        lines.append(f"samples: {self.run_dir.samples_dir}")
        if self.config.logging.tensorboard:
            lines.append(f"tensorboard: tensorboard --logdir {self.run_dir.tensorboard_dir}")
        if complete:
            latest = complete[-1][1]
            lines.append(f"checkpoint: {latest} (export: leangrpo-convert mcore-to-diffusers --src {latest} "
                         f"--dst {os.path.join(self.run_dir.root, 'diffusers')})")
        print("\n".join(lines), file=sys.stdout, flush=True)


def train(config: Config) -> LoopState:
    """Run training for ``config`` on this process (torchrun rank or a lone process); returns the counters.

    Rank 0 holds the run directory's lock (:mod:`~leangrpo_mcore.engine.run_lock`) from before the build until
    the end; a directory another trainer holds is a one-line error on every rank. A run stopped by a
    preemption signal returns with :attr:`LoopState.stopped_by_signal` set (the CLI exits with
    :func:`~leangrpo_mcore.engine.preemption.exit_code` of it).
    """
    dist_ctx = init_distributed(timeout_s=config.parallel.timeout_minutes * 60.0)
    logger = get_logger(dist_ctx.rank)
    lock = None
    try:
        with user_errors():
            lock = lock_run_dir(config.train.output_dir, warn=logger.warning)
            trainer = Trainer(config, dist_ctx, logger)
        return trainer.run()
    finally:
        if lock is not None:
            lock.release()
        destroy_parallel_context()
        shutdown(dist_ctx)

