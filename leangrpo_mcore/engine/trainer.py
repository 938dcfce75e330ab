"""The training loop: build from the config, resume, run ``train.max_steps`` steps, log, checkpoint, summarise.

Robustness rules:

- bad input found while building (config values, paths, layouts, checkpoints) is a one-line
  :class:`~leangrpo_mcore.errors.UserError` on every rank;
- a reward that fails or returns NaN/inf on any rank stops every rank after the step with that reward's
  one-line error, before anything of that step is logged or saved;
- an update whose gradient is non-finite on any rank is skipped (the optimizer sees no gradient, so neither
  the weights nor the optimizer state change) and logged; ``train.max_nonfinite_skips`` consecutive skips stop
  the run.

The loop is a short script over the engine's rooms: the parts come from :mod:`~leangrpo_mcore.engine.build`,
the step from :mod:`~leangrpo_mcore.engine.step` (scored through :mod:`~leangrpo_mcore.engine.reward_bridge`),
checkpoints from :mod:`~leangrpo_mcore.engine.checkpoint`, the lock, signals, watchdog, failed writes and
non-finite updates from :mod:`~leangrpo_mcore.engine.control`, and what the run writes from
:mod:`~leangrpo_mcore.engine.output`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from leangrpo_mcore.config import Config, config_to_yaml
from leangrpo_mcore.config.drift import record_launch_config
from leangrpo_mcore.engine import build, checkpoint
from leangrpo_mcore.engine.checkpoint.resume import check_compatible, compare_configs
from leangrpo_mcore.engine.control.io_failures import IOFailures
from leangrpo_mcore.engine.control.lock import lock_run_dir
from leangrpo_mcore.engine.control.nonfinite import NonFiniteGuard, check_streak
from leangrpo_mcore.engine.control.preemption import (PreemptionFlag, agree_after_step, exit_code,
                                                      set_aside_interrupted, signal_name, write_marker)
from leangrpo_mcore.engine.control.watchdog import StepWatchdog
from leangrpo_mcore.engine.evaluate import Evaluator, eval_rewards, write_eval_grid
from leangrpo_mcore.engine.launch import (DistContext, first_error, get_logger, init_distributed, raise_if_any,
                                          shutdown, user_errors)
from leangrpo_mcore.engine.output.metrics import MetricsLogger, ProgressBar, step_row
from leangrpo_mcore.engine.output.run_dir import RunDir, append_jsonl, check_fresh_run, prepare, read_metrics
from leangrpo_mcore.engine.output.summary import run_summary
from leangrpo_mcore.engine.output.samples import beside_sources, save_grid
from leangrpo_mcore.engine.output.video import write_video_grid
from leangrpo_mcore.engine.output.wandb_log import open_wandb
from leangrpo_mcore.engine.references import StepReferences
from leangrpo_mcore.engine.reward_bridge import RewardBridge
from leangrpo_mcore.engine.step import StepInputs, StepResult
from leangrpo_mcore.engine.throughput import step_throughput
from leangrpo_mcore.parallel.mesh import destroy_parallel_context
from leangrpo_mcore.parallel.precision import fp8_precision

SAMPLE_GRID_MAX = 16
"""At most this many generations appear in a sample grid."""


def _sample_order(item: tuple) -> tuple:
    """Sample grids list the generations by prompt id, then prompt text."""
    return item[3], item[1]


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
        # UserError unless the checkpoint trains the same model; False when it was written at another layout.
        same_layout = check_compatible(self.resume_path, self._layout_record(), self.log) if self.resume_path else True
        self.data = build.build_data_parts(config, self.family, self.hyper, dist_ctx.device, self.pctx)
        self.parts = build.build_policy_parts(config, self.pctx, self.precision, source=self.source)
        self.bridge = RewardBridge(self.data, config)
        self.engine = build.build_engine(config, self.schedule, self.parts, self.pctx, self.bridge)
        self.references = None if self.data.images is None else StepReferences(
            self.data.images, self.data.decoder, self.family.name, [s.prompt_slot for s in self.engine.shares],
            build.reference_run(config, self.hyper))
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
        self.checkpoints = checkpoint.CheckpointWriter(self.run_dir, keep_last=config.checkpoint.keep_last,
                                                       log=logger, is_main=dist_ctx.is_main)
        self.watchdog: Optional[StepWatchdog] = None
        self.phase_now = ("start-up", 0, time.monotonic())
        """(phase, step, monotonic time it began) of this rank, for the preemption watcher."""
        if self.resume_path is not None:
            self._resume(self.resume_path, same_layout)
        self.config_yaml = config_to_yaml(config)
        first_error(prepare, self.run_dir, self.config_yaml, resume_step=self.state.step or None)
        first_error(record_launch_config, self.run_dir.root, self.state.step, self.config_yaml)
        enabled = dist_ctx.is_main
        wandb = open_wandb(config, self.run_dir.root, resumed=self.resume_path is not None, enabled=enabled)
        self.io = IOFailures()
        with self.io.recording():
            self.metrics = MetricsLogger(self.run_dir.metrics_path,
                                         self.run_dir.tensorboard_dir if config.logging.tensorboard else None,
                                         enabled=enabled, purge_step=self.state.step + 1, wandb=wandb)
        raise_if_any(self.io.first)
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
        path = checkpoint.resolve_resume(spec, self.run_dir, warn=self.log.warning,
                                         verify=self.config.checkpoint.verify)
        first_error(self._prepare_fresh, spec, path)
        return path

    def _prepare_fresh(self, spec: Optional[str], path: Optional[str]) -> None:
        if path is None and spec in checkpoint.AUTO:
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

    def _resume(self, path: str, same: bool) -> None:
        p = self.parts
        data_changed = compare_configs(path, self.config, fingerprint=self.prompts_fingerprint, planned=self.planned,
                                       log=self.log)
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

    def run(self) -> LoopState:
        """Train until ``train.max_steps`` or a preemption signal (see :meth:`_stop_on_signal`); returns the
        final counters."""
        cfg = self.config
        minutes = cfg.parallel.timeout_minutes
        signals = PreemptionFlag(cfg.train.save_on_signal, stalled_after_s=minutes * 60.0,
                                 phase=lambda: self.phase_now, rank=self.dist.rank,
                                 setting=f"parallel.timeout_minutes={minutes:g}")
        self.watchdog = self._start_watchdog()
        self.bridge.watchdog = self.watchdog
        try:
            if cfg.eval.before_train and self.state.step == 0:
                self._evaluate(0)
            if self._eval_missing_after_resume():
                self._evaluate(self.state.step)
            for step in range(self.state.step + 1, cfg.train.max_steps + 1):
                self._train_step(step)
                self._phase("signal check")
                signum = self._after_step(step, signals.signum)
                if signum and step < cfg.train.max_steps:  # after the last step the run ends as usual
                    self._stop_on_signal(step, signum)
                    break
                if self._save_due(step):
                    self._save(step)
                if cfg.eval.every and step % cfg.eval.every == 0:
                    self._evaluate(step)
            self._phase("checkpoint save")
            self.checkpoints.finish()
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

    def _eval_missing_after_resume(self) -> bool:
        """Collective: whether the evaluation due at the resumed step has no row in ``eval.jsonl`` (it failed, or a
        preemption stopped the launch between the step's save and its evaluation): it is done first, so that the
        file has no hole."""
        step, every = self.resumed_step, self.config.eval.every
        if self.evaluator is None or step is None or not every or step % every:
            return False
        return first_error(lambda: not any(row.get("step") == step for row in read_metrics(self.run_dir.eval_path)))

    def _start_watchdog(self) -> Optional[StepWatchdog]:
        minutes = self.config.train.step_timeout_minutes
        if minutes <= 0:
            return None
        return StepWatchdog(minutes * 60.0, self.dist.rank, self.dist.world_size,
                            setting=f"train.step_timeout_minutes={minutes:g}")

    def _phase(self, name: str, step: Optional[int] = None) -> None:
        """Record what this rank does now (``phase_now``, read after a preemption signal) and tell the step watchdog
        (if any)."""
        self.phase_now = (name, self.phase_now[1] if step is None else step, time.monotonic())
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
        sources = None
        if self.references is not None:
            self._phase("conditioning images", step)
            conditioning, sources = self.references.attach(conditioning, prompt_ids)
        self.bridge.begin_step(capture=self._sample_due(step), sources=sources)
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
        with self.io.recording():
            self.metrics.log(step, row)
        self.progress.update(step, row)
        if self.bridge.capture:
            self._write_samples(step)

    def _after_step(self, step: int, signum: int) -> int:
        """Collective, one all-reduce for all three: stop after a failed write (the step's checkpoint saved first
        when due), report a background write that every rank has finished, stop a diverged run; returns the
        preemption signal the ranks agree on (0: none)."""
        control = agree_after_step(signum, self.io.first is not None, self.checkpoints.running)
        if control.io_failed:
            self._stop_on_io_failure(step, save_due=self._save_due(step))
        self.checkpoints.poll(control.saving)
        check_streak(step, self.state.nonfinite_streak, resumed_step=self.resumed_step,
                     max_skips=self.config.train.max_nonfinite_skips)
        return control.signum

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
        self.state.step_times.append(elapsed)
        return step_row(result, elapsed=elapsed, skipped=skipped, lr=lr,
                        reward_names=list(self.config.reward.weights or {}),
                        nonfinite_streak=self.state.nonfinite_streak,
                        throughput=self.throughput.scalars(elapsed, text_tokens))

    def _write_samples(self, step: int) -> None:
        """samples/step_<N>.png (first frames) and, for a video policy, samples/step_<N>.mp4 (rank 0); each tile
        [source | result] in an image-conditioned run."""
        # The grid shows the first SAMPLE_GRID_MAX in this order: no rank needs to send more than that.
        local = sorted(self.bridge.samples, key=_sample_order)[:SAMPLE_GRID_MAX]
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        if not self.dist.is_main or self.io.first is not None:
            return
        items = sorted((item for part in gathered for item in part), key=_sample_order)[:SAMPLE_GRID_MAX]
        if not items:
            return
        prompts, rewards = [it[1] for it in items], [it[2] for it in items]
        sources = np.stack([it[5] for it in items]) if all(it[5] is not None for it in items) else None
        paired = (lambda tiles: tiles) if sources is None else (lambda tiles: beside_sources(tiles, sources))
        frames = paired(np.stack([it[0] for it in items]))
        images = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
        with self.io.recording():
            grid = save_grid(self.run_dir.sample_path(step), images, prompts, rewards)
            self.metrics.add_image("samples", np.asarray(grid), step)
            if all(it[4] is not None for it in items):
                path, fps = self.run_dir.video_path(step), self.config.logging.video_fps
                write_video_grid(path, paired(np.stack([it[4] for it in items])), prompts, rewards, fps=fps)
                self.metrics.add_video("samples_video", path, step, fps)

    def _evaluate(self, step: int) -> None:
        """Evaluate the current weights: ``eval.jsonl``, ``eval/`` scalars and the eval grid (first rank)."""
        self._phase("evaluation")
        with user_errors():
            result = self.evaluator.evaluate(step)
        if result is not None:  # the first rank's: it writes
            with self.io.recording():
                append_jsonl(self.run_dir.eval_path, result.to_json())
                self.metrics.log_scalars(step, result.scalars())
            self.log.info("eval at step %d: %s (%d prompts x %d, %.1f s)", step,
                          ", ".join(f"{name} {stats['mean']:.4f}" for name, stats in result.rewards.items()),
                          result.num_prompts, result.samples_per_prompt, result.time_s)
            if result.samples and self.io.first is None:
                with self.io.recording():
                    write_eval_grid(self.run_dir, step, result.samples, self.metrics,
                                    fps=self.config.logging.video_fps)
        self._stop_on_io_failure(step, save_due=False)  # the step's checkpoint was written before the evaluation

    def _stop_on_io_failure(self, step: int, *, save_due: bool) -> None:
        """Collective: after a failed write on rank 0, stop every rank with its one line, the step's checkpoint
        (when ``save_due``) written first (:mod:`~leangrpo_mcore.engine.control.io_failures`)."""
        self.io.stop_if_any(step, save=(lambda: self._save(step, sync=True)) if save_due else None,
                            finish=self.checkpoints.finish)

    def _save(self, step: int, sync: bool = False) -> str:
        """Write the checkpoint of ``step``: published before this returns, or with ``checkpoint.async_save``
        (unless ``sync``) by a background thread as soon as its files are written; returns its final path."""
        self._phase("checkpoint save")
        self.checkpoints.finish()
        p = self.parts
        record = {**self._layout_record(), "sampler": self.data.sampler.state_dict(),
                  "nonfinite_streak": self.state.nonfinite_streak, "prompts_fingerprint": self.prompts_fingerprint}
        background = self.config.checkpoint.async_save and not sync
        return self.checkpoints.save(step, background=background, model=p.policy, optimizer=p.optimizer,
                                     lr_scheduler=p.lr_scheduler, ema=p.ema, layout=p.tp_layout, state=record,
                                     config_yaml=self.config_yaml)

    def _summary(self) -> None:
        if self.dist.is_main:
            head = (f"finished {self.state.step} / {self.config.train.max_steps} steps ({self.schedule} schedule, "
                    f"world size {self.dist.world_size})")
            print(run_summary(self.run_dir, head, self.state.step_times,
                              tensorboard=self.config.logging.tensorboard), file=sys.stdout, flush=True)


def train(config: Config) -> LoopState:
    """Run training for ``config`` on this process (torchrun rank or a lone process); returns the counters.

    Rank 0 holds the run directory's lock (:mod:`~leangrpo_mcore.engine.control.lock`) from before the build until
    the end; a directory another trainer holds is a one-line error on every rank. A run stopped by a
    preemption signal returns with :attr:`LoopState.stopped_by_signal` set (the CLI exits with
    :func:`~leangrpo_mcore.engine.control.preemption.exit_code` of it).
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
