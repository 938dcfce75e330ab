"""``leangrpo-plan`` reads no weights: every preset simulates without ``model.path`` (the refusal of a weightless
full-size preset is the trainer's), and ``--json`` counts each candidate's parameters as the trainer's build holds
them."""

import dataclasses

import pytest
import torch

from leangrpo_mcore.cli.plan import build_parser, make_plan
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.model_source import resolve_model_source
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.registry import available_families
from leangrpo_mcore.planner.arch_specs import BUILTIN_PRESETS
from leangrpo_mcore.planner.simulate import fake_world, simulate_step

TINY = {"flux": ("yaml_configs/tiny/flux.yaml", "flux-tiny"), "sd3": ("yaml_configs/tiny/sd3.yaml", "sd3-tiny"),
        "wan": ("yaml_configs/tiny/wan.yaml", "tiny"),
        "qwen_image": ("yaml_configs/tiny/qwen_image.yaml", "qwen-image-tiny")}


def _weightless(preset: str):
    """The tiny config of the preset's family naming the full-size ``preset`` (no ``model.path``), its
    architecture shrunk to the tiny preset's sizes so that the simulated step takes a second."""
    family = BUILTIN_PRESETS[preset][0]
    path, tiny = TINY[family]
    sizes = next(f for f in available_families() if f.name == family).presets[tiny]
    config = load_config(path, ["sampler.num_steps=3", "sampler.height=32", "sampler.width=32",
                                "grpo.prompts_per_step=1", "grpo.group_size=2"])
    model = dataclasses.replace(config.model, preset=preset, arch=dict(sizes), path=None)
    return dataclasses.replace(config, model=model)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(BUILTIN_PRESETS))
def test_every_preset_simulates_without_weights_and_training_still_refuses(preset):
    config = _weightless(preset)
    with pytest.raises(UserError, match=f"^model.path is not set: preset {preset} would RL-train"):
        resolve_model_source(config)  # what the trainer and leangrpo-eval call
    sim = simulate_step(config, 2)
    assert sim.peak_bytes > 0 and sim.breakdown["parameters"] > 0


def _local_parameters(config, world_size, rank):
    """Parameters rank ``rank`` of ``world_size`` stores after the trainer's build (TP slices, FSDP2 shards)."""
    from leangrpo_mcore.engine import build
    from leangrpo_mcore.engine.launch import DistContext

    with fake_world(world_size, config.parallel.tp, config.parallel.cp, rank):
        pctx = build.build_context(config, DistContext(rank, world_size, 0, torch.device("cpu"), "fake", False))
        parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx), fill_values=False)
        stored = [p.to_local() if hasattr(p, "to_local") else p for p in parts.policy.parameters()]
        trainable = [p.to_local() if hasattr(p, "to_local") else p for p in parts.policy.parameters()
                     if p.requires_grad]
        return sum(t.numel() for t in stored), sum(t.numel() for t in trainable)


@pytest.mark.parametrize("lora", [0, 4])
def test_json_parameters_are_what_the_built_ranks_hold(lora):
    """total / trainable against the unsharded build (one rank), per_rank / trainable_per_rank against the FSDP2
    shards of every rank of a tp=2 x dp_shard=2 build: the mean of the shards, within a row's rounding."""
    overrides = [f"model.lora.rank={lora}", "model.lora.alpha=8"]
    args = build_parser().parse_args(["--config", "yaml_configs/tiny/flux.yaml", *overrides, "parallel.tp=2",
                                      "--gpus-per-node", "4", "--gpu-mem-gb", "80", "--json"])
    plan = make_plan(args)
    rows = plan.to_dict()["candidates"]
    row = next(r for r in rows if (r["tp"], r["dp_shard"], r["pp"], r["cp"]) == (2, 2, 1, 1))
    counts = row["parameters"]
    base = load_config("yaml_configs/tiny/flux.yaml", overrides + ["parallel.dp_shard=1", "parallel.dp_replicate=1"])
    assert (counts["total"], counts["trainable"]) == _local_parameters(base, 1, 0)
    if lora == 0:
        assert counts["trainable"] == counts["total"]
    else:
        assert 0 < counts["trainable"] < counts["total"] / 5
    sharded = load_config("yaml_configs/tiny/flux.yaml", overrides + ["parallel.tp=2", "parallel.dp_shard=2",
                                                                      "parallel.dp_replicate=1"])
    held = [_local_parameters(sharded, 4, rank) for rank in range(4)]
    for index, key in enumerate(("per_rank", "trainable_per_rank")):
        mean = sum(h[index] for h in held) / 4
        assert mean <= counts[key] < mean + 1, (key, counts[key], held)
        assert counts[key] < counts["total" if index == 0 else "trainable"] / 1.9  # TP and FSDP both split
    assert all(r["parameters"]["total"] == counts["total"] for r in rows)
