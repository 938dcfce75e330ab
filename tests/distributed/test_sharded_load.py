"""Meta-device build, then FSDP2/TP, then each rank's shards read straight from the checkpoint files.

A policy saved as a diffusers directory (one file, and a sharded set with an index) or in our format loads at
world size 2 under FSDP2 (dp_shard=2) and under TP=2 into exactly the tensors of the saved policy, and a random
init is the same at every layout. Each rank allocates only its shards.
"""

import json

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

TINY_FLUX = "yaml_configs/tiny/flux.yaml"


def _saved(tmp_path):
    """The reference policy, written as a diffusers dir, a two-file sharded diffusers dir and our format."""
    from leangrpo_mcore.models import build_policy, get_family, save_policy
    from leangrpo_mcore.models.common import checkpoint as ckpt

    model = build_policy({"family": "flux", "preset": "flux-tiny"}, seed=7, backend="local")
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    family = get_family("flux")
    converted = family.mcore_to_diffusers(tensors, model.config)
    ckpt.write_diffusers_dir(tmp_path / "single", class_name=family.diffusers_class_name,
                             config=model.config.to_diffusers_config(), tensors=converted)
    sharded = tmp_path / "sharded"
    ckpt.write_diffusers_dir(sharded, class_name=family.diffusers_class_name,
                             config=model.config.to_diffusers_config(), tensors={})
    (sharded / ckpt.DIFFUSERS_WEIGHTS).unlink()
    keys = sorted(converted)
    halves = {"part-1.safetensors": keys[::2], "part-2.safetensors": keys[1::2]}
    for name, part in halves.items():
        ckpt.save_safetensors({k: converted[k] for k in part}, sharded / name)
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (sharded / ckpt.DIFFUSERS_INDEX).write_text(json.dumps(index))
    save_policy(model, tmp_path / "ours")
    return tensors


def _load(rank, world_size, folders, tp):
    from torch.distributed.tensor import DTensor

    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine import build
    from leangrpo_mcore.engine.launch import init_distributed
    from leangrpo_mcore.models.common.tp import gather_tensor
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    dist_ctx = init_distributed()
    out = {}
    for folder in folders:
        path = [f"model.path={folder}"] if folder else ["model.seed=7"]
        cfg = load_config(TINY_FLUX, path + [f"parallel.tp={tp}"])
        pctx = build.build_context(cfg, dist_ctx)
        parts = build.build_policy_parts(cfg, pctx, build.precision_of(cfg, pctx))
        full, local_elements, tp_share = {}, 0, 0
        for name, p in parts.policy.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local_elements += local.numel()
            value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            full[name] = gather_tensor(value, parts.tp_layout[name]).cpu()
            split = getattr(parts.tp_layout[name], "tensor_model_parallel", False)
            tp_share += full[name].numel() // tp if split else full[name].numel()
        out[folder or "random"] = (full, local_elements, tp_share)
        destroy_parallel_context()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_every_source_loads_the_same_tensors_at_world_size_2(tmp_path, tp):
    reference = _saved(tmp_path)
    folders = [str(tmp_path / "single"), str(tmp_path / "sharded"), str(tmp_path / "ours"), None]
    results = run_ranks(_load, 2, folders, tp, timeout=300)
    total = sum(t.numel() for t in reference.values())
    for rank_result in results:
        for source, (full, _, _) in rank_result.items():
            assert full.keys() == reference.keys(), source
            for name, tensor in reference.items():
                assert torch.equal(full[name], tensor), (source, name)
    for source in results[0]:
        held = [r[source][1] for r in results]
        if tp == 1:  # FSDP2 over 2 ranks: the shards add up to the model, none holds more than ~half
            assert sum(held) == total and max(held) < 0.6 * total, (source, held)
        else:  # TP=2: each rank holds its TP slice only (adaLN and norms are replicated)
            assert held == [r[source][2] for r in results] and max(held) < total, (source, held)
