"""Evaluate a model without training: a run's checkpoint, or the policy that ``model.path`` names.

Every rank builds what a training run builds (the parallel layout, the policy, its text encoder and VAE) except the
prompt sampler, the training reward and the step engine, loads the checkpoint's weights (and EMA) when one is given,
and runs one :class:`~leangrpo_mcore.engine.evaluate.Evaluator` pass.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from leangrpo_mcore.config import Config
from leangrpo_mcore.engine import build, checkpoint
from leangrpo_mcore.engine.checkpoint.verify import verify_before_reading
from leangrpo_mcore.engine.evaluate import EvalResult, Evaluator, eval_rewards
from leangrpo_mcore.engine.launch import get_logger, init_distributed, shutdown, user_errors
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.mesh import Layout, destroy_parallel_context
from leangrpo_mcore.parallel.precision import fp8_precision


def _check_checkpoint(path: str, family: str, hyper: dict, lora: Optional[dict]) -> int:
    """The checkpoint's step; UserError unless it holds a policy of this config's family, shape and adapters."""
    try:
        saved = checkpoint.read_state(path)
    except (OSError, ValueError) as err:
        raise UserError(f"--checkpoint {path}: not a readable training checkpoint ({err})") from None
    mine = json.loads(json.dumps({"family": family, "model_config": hyper, "lora": lora}))
    for key, value in mine.items():
        if saved.get(key) != value:
            raise UserError(f"--checkpoint {path} does not match --config: its {key} is {saved.get(key)!r}, the "
                            f"config's is {value!r} (pass the run's own RUN/config.yaml)")
    return int(saved.get("step", 0))


def _eval_layout(config: Config, world_size: int, logger) -> Config:
    """``config`` with data-parallel degrees this world can run. A run's ``RUN/config.yaml`` records the degrees
    its launch resolved (the planner's, for another world size perhaps); evaluation runs no update, so degrees
    that do not divide this world give way to FSDP2 over every data-parallel rank, said in one line."""
    p = config.parallel
    try:
        Layout.from_config(p).resolve(world_size)
        return config
    except ValueError as err:
        reason = err
    default = dataclasses.replace(p, dp_shard="auto", dp_replicate="auto")
    try:
        Layout.from_config(default).resolve(world_size)
    except ValueError:
        raise reason from None  # the model-parallel degrees do not fit either: the layout's own error
    logger.info("evaluation at world size %d: parallel.dp_shard=%s parallel.dp_replicate=%s (%s) give way to FSDP2 "
                "over every data-parallel rank", world_size, p.dp_shard, p.dp_replicate, reason)
    return dataclasses.replace(config, parallel=default)


def evaluate_model(config: Config, checkpoint_path: Optional[str] = None) -> Optional[EvalResult]:
    """Collective over the launched ranks: evaluate ``checkpoint_path`` (a ``RUN/checkpoints/step_<N>``) or, without
    one, the model of ``config``; the result on the first rank, None elsewhere."""
    if config.schedule.name == "auto":  # evaluation runs no update: any schedule builds the same policy
        config = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, name="native"))
    dist_ctx = init_distributed()
    logger = get_logger(dist_ctx.rank)
    try:
        with user_errors():
            config = _eval_layout(config, dist_ctx.world_size, logger)
            pctx = build.build_context(config, dist_ctx)
            precision = build.precision_of(config, pctx)
            source = build.resolve_model_source(config)
            step = 0
            if checkpoint_path is not None:
                verify_before_reading(checkpoint_path, "--checkpoint", enabled=config.checkpoint.verify, log=logger)
                step = _check_checkpoint(checkpoint_path, source.family.name, source.hyper, source.lora)
            text, decoder = build.build_text_and_vae(config, source.family, source.hyper, dist_ctx.device)
            parts = build.build_policy_parts(config, pctx, precision, source=source)
            if checkpoint_path is not None:
                # the weights and their EMA only: an evaluation never uses the optimizer state
                checkpoint.load_weights(checkpoint_path, model=parts.policy, ema=parts.ema, layout=parts.tp_layout,
                                        warn=logger.warning)
                logger.info("evaluating %s (step %d)", checkpoint_path, step)
            rewards = build.scoring_reward(lambda: eval_rewards(config, None), pctx)
            forward = fp8_precision(parts.policy) if config.model.fp8 else None
            evaluator = Evaluator(config, parts=parts, pctx=pctx, text_encoder=text, decoder=decoder,
                                  rewards=rewards, forward_context=forward)
            return evaluator.evaluate(step)
    finally:
        destroy_parallel_context()
        shutdown(dist_ctx)
