"""The EMA of a training run against its formula: with ``train.ema_decay = d`` the shadow starts at the initial
weights θ₀ and after the optimizer steps giving θ₁ and θ₂ it is d·θ₀ + (1 − d)·θ₁, then d·(d·θ₀ + (1 − d)·θ₁) +
(1 − d)·θ₂. θ₁, θ₂ and the shadows are read from the run's checkpoints, θ₀ from a fresh build of the same
configuration (seeded initialisation); the comparison is in float64, relative to how far the weights moved.
"""

from pathlib import Path

import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.launch import init_distributed, shutdown
from leangrpo_mcore.parallel.mesh import destroy_parallel_context
from tests.ckpt_helpers import model_tensors, stored_tensors

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
DECAY = 0.7
OVERRIDES = ["train.max_steps=2", f"train.ema_decay={DECAY}", "checkpoint.save_every=1",
             "optim.max_grad_norm=0", "logging.tensorboard=false"]


def _initial_weights(config) -> dict[str, torch.Tensor]:
    """θ₀: the trainable parameters of a fresh build of ``config`` (the run built the same seeded policy)."""
    dist_ctx = init_distributed()
    try:
        pctx = build.build_context(config, dist_ctx)
        parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx))
        return {name: p.detach().double().clone() for name, p in parts.policy.named_parameters() if p.requires_grad}
    finally:
        destroy_parallel_context()
        shutdown(dist_ctx)


def _flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[name].double().flatten() for name in names])


def test_ema_after_two_steps_is_the_formula(tmp_path):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    assert train_main(["--config", TINY_FLUX, f"train.output_dir={run}", *OVERRIDES]) == 0
    theta0 = _initial_weights(load_config(TINY_FLUX, [f"train.output_dir={tmp_path / 'fresh'}", *OVERRIDES]))
    names = sorted(theta0)
    ckpts = run / "checkpoints"
    theta1, theta2 = (_flat(model_tensors(ckpts / f"step_{k}"), names) for k in (1, 2))
    ema1, ema2 = (_flat(stored_tensors(ckpts / f"step_{k}", "ema/"), names) for k in (1, 2))
    theta0 = _flat(theta0, names)
    moved = float((theta2 - theta0).norm())
    assert float((theta1 - theta0).norm()) > 0 and float((theta2 - theta1).norm()) > 0  # both steps moved the weights
    want1 = DECAY * theta0 + (1 - DECAY) * theta1
    want2 = DECAY * want1 + (1 - DECAY) * theta2
    # fp32 shadows: rounding is ~1e-7 of the weights, far below a mis-weighted step (a fraction of ``moved``)
    errors = [float((ema1 - want1).norm()) / moved, float((ema2 - want2).norm()) / moved]
    assert max(errors) <= 1e-3, errors
