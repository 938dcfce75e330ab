"""Master weights, compute dtype and provisional-gradient dtype: what each config means and what it does."""

import dataclasses

import pytest
import torch

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.planner.layout import precision_from_config
from leangrpo_mcore.parallel.precision import run_precision
from tests.ckpt_helpers import model_tensors, stored_tensors
from tests.unit.test_train_cli import TINY_FLUX

def contrast(images, prompts):
    """Pixel contrast (a reward plugin): smooth in the pixels and spread enough over a group that bf16 rounding
    of the rollout does not reorder the generations."""
    return images.std(dim=(1, 2, 3)) * 10


def _update(tmp_path, name, *overrides):
    """(update of every weight after 3 steps, dtypes of weights and optimizer state) of a tiny FLUX run."""
    run = tmp_path / name
    assert main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=3", "logging.progress_bar=false",
                 "logging.tensorboard=false", "reward.name=tests.unit.test_precision:contrast", *overrides]) == 0
    init = dict(build_policy({"family": "flux", "preset": "flux-tiny"}, seed=0, backend="local").named_parameters())
    weights = model_tensors(run / "checkpoints" / "step_3")
    optim = stored_tensors(run / "checkpoints" / "step_3", "optim/")
    delta = torch.cat([(weights[k].double() - init[k].detach().to(weights[k].dtype).double()).flatten()
                       for k in sorted(weights)])
    return delta, {t.dtype for t in weights.values()}, {t.dtype for t in optim.values() if t.ndim}


def _cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def test_fp32_master_weights_keep_small_updates_that_bf16_master_weights_lose(tmp_path):
    adamw = ("optim.lr=1e-6",)
    mixed, weight_dtypes, optim_dtypes = _update(tmp_path, "mixed", *adamw, "model.dtype=bfloat16")
    assert weight_dtypes == optim_dtypes == {torch.float32}
    assert float((mixed != 0).double().mean()) > 0.99  # every weight moved
    lossy, weight_dtypes, optim_dtypes = _update(tmp_path, "bf16", *adamw, "model.dtype=bfloat16",
                                                 "model.master_dtype=bfloat16")
    assert weight_dtypes == optim_dtypes == {torch.bfloat16}
    assert float((lossy != 0).double().mean()) < 0.05  # a 1e-6 step rounds away in bf16 (8 mantissa bits)


def test_bf16_compute_update_points_where_the_fp32_one_does(tmp_path):
    # SGD: the update is the gradient itself. (AdamW divides each element by its own gradient scale, which
    # turns the bf16 rounding of near-zero gradients into opposite signs: measured cosine 0.85 here.)
    # train.seed=1: at seed 0 one group's two contrasts lie within bf16 rounding of each other, so its ±1
    # advantages swap sign between the runs (measured cosine 0.84); seeds 1-3 measured 0.993-0.994.
    sgd = ("optim.name=sgd", "optim.lr=1e-3", "train.seed=1")
    reference, _, _ = _update(tmp_path, "fp32", *sgd)
    mixed, dtypes, _ = _update(tmp_path, "mixed", *sgd, "model.dtype=bfloat16")
    assert dtypes == {torch.float32}
    assert _cos(reference, mixed) >= 0.99
    assert not torch.equal(reference, mixed)  # the forwards did run in bf16


def test_legacy_config_means_fp32_master_and_says_so(tmp_path, capsys):
    cfg = load_config(TINY_FLUX, ["model.dtype=bfloat16"])
    precision = run_precision(cfg.model, cfg.parallel, cfg.schedule)
    assert (precision.compute, precision.master, precision.provisional) == ("bfloat16", "float32", "float32")
    assert "model.master_dtype" in precision.legacy_note
    explicit = load_config(TINY_FLUX, ["model.dtype=bfloat16", "model.master_dtype=float32"])
    assert run_precision(explicit.model, explicit.parallel, explicit.schedule).legacy_note is None
    assert main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1",
                 "logging.progress_bar=false", "model.dtype=bfloat16"]) == 0
    assert capsys.readouterr().err.count("is the compute dtype; the master weights and the optimizer state") == 1


def test_contradicting_dtypes_are_one_line(tmp_path, capsys):
    for overrides, text in ((["parallel.param_dtype=bfloat16"], "differs from model.dtype=float32"),
                            (["model.dtype=float32", "model.master_dtype=bfloat16"], "is wider than")):
        assert main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'x'}", *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and text in err[0]


@pytest.mark.parametrize("provisional,expected", [(None, 4), ("bfloat16", 2), ("float32", 4)])
def test_planner_charges_the_provisional_dtype(provisional, expected):
    cfg = load_config(TINY_FLUX, ["model.dtype=bfloat16"])
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, provisional_dtype=provisional))
    precision = precision_from_config(cfg)
    assert (precision.storage_bytes, precision.compute_bytes, precision.buffer_bytes) == (4, 2, expected)


def test_bf16_provisional_gradients_train_like_fp32_ones(tmp_path):
    sgd = ("optim.name=sgd", "optim.lr=1e-3", "schedule.name=reweight")
    reference, _, _ = _update(tmp_path, "fp32", *sgd)
    low, _, _ = _update(tmp_path, "bf16", *sgd, "schedule.provisional_dtype=bfloat16")
    assert _cos(reference, low) >= 0.99 and not torch.equal(reference, low)


def test_fp8_without_transformer_engine_is_one_line(tmp_path, capsys):
    from leangrpo_mcore.models.backends import te_available

    assert not te_available()  # CPU CI: the TE path itself is tested in tests/gpu
    for backend in ("local", "auto"):
        assert main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / backend}", "model.fp8=tensorwise",
                     f"model.backend={backend}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.fp8=tensorwise needs the Transformer Engine backend" in err[0]
    assert not (tmp_path / "local" / "checkpoints").exists()


def test_fp8_reaches_a_policy_loaded_from_a_path(tmp_path):
    from leangrpo_mcore.models import save_policy
    from leangrpo_mcore.models.common.fp8 import fp8_config
    from leangrpo_mcore.models.registry import read_policy_files

    save_policy(build_policy({"family": "flux", "preset": "flux-tiny"}, seed=0, backend="local"), tmp_path / "p")
    files = read_policy_files(tmp_path / "p")
    assert files.config.fp8 is None  # FP8 is not stored with the weights ...
    config = fp8_config(files.config, "mxfp8")  # ... the run applies it, as build_policy_parts does
    assert (config.fp8, config.fp8_recipe, config.tp_only_amax_red) == ("hybrid", "mxfp8", True)
    with pytest.raises(ValueError, match="delayed scaling is not offered"):
        fp8_config(files.config, "delayed")


def test_lora_base_is_held_in_the_compute_dtype_and_adapters_in_the_master_dtype(tmp_path):
    """A frozen base needs no master copy: bf16 compute keeps it in bf16 (half of fp32), the adapters and their
    optimizer state stay fp32, and the base does not move."""
    run = tmp_path / "lora"
    assert main(["--config", TINY_FLUX, f"train.output_dir={run}", "train.max_steps=3", "logging.progress_bar=false",
                 "logging.tensorboard=false", "reward.name=tests.unit.test_precision:contrast", "model.dtype=bfloat16",
                 "model.lora.rank=4", "optim.lr=1e-3"]) == 0
    weights = model_tensors(run / "checkpoints" / "step_3")
    optim = stored_tensors(run / "checkpoints" / "step_3", "optim/")
    assert {t.dtype for t in optim.values() if t.ndim} == {torch.float32}
    base = {k: v for k, v in weights.items() if "lora_" not in k}
    adapters = {k: v for k, v in weights.items() if "lora_" in k}
    assert base and adapters
    assert {v.dtype for v in base.values()} == {torch.bfloat16}
    assert {v.dtype for v in adapters.values()} == {torch.float32}
    init = dict(build_policy({"family": "flux", "preset": "flux-tiny"}, seed=0, backend="local").named_parameters())
    for name, value in base.items():  # the base is the seeded init rounded once to bf16, unchanged by training
        assert torch.equal(value, init[name].detach().to(torch.bfloat16)), name
