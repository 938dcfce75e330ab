"""Checkpoints reshard on load: saved at TP=2 they load at TP=1, saved at TP=1 they load at TP=2."""

import pytest
import torch

from tests.distributed.launcher import run_ranks

pytestmark = pytest.mark.distributed

TINY = {"family": "flux", "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2,
        "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24,
        "guidance_embeds": False, "axes_dims_rope": [4, 6, 6]}


def _inputs():
    gen = torch.Generator().manual_seed(11)
    img, txt = 12, 5
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 3, torch.arange(img) % 3], dim=1)
    return dict(hidden_states=torch.randn(1, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(1, txt, 32, generator=gen),
                pooled_projections=torch.randn(1, 24, generator=gen), timestep=torch.tensor([0.6]),
                img_ids=img_ids, txt_ids=torch.zeros(txt, 3))


def _lora_model(seed):
    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy
    from leangrpo_mcore.models.common.tp import full_shape, shard_tensor

    model = build_policy(TINY, seed=seed)
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=("attn.to_q", "proj_out", "ff")), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                shape = full_shape(param)
                param.copy_(shard_tensor(torch.linspace(-1, 1, shape.numel()).view(shape), param))
    return model


def _tp2_rank(rank, world_size, tp1_dir, tp2_dir):
    from megatron.core import parallel_state

    from leangrpo_mcore.models import load_policy, save_policy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        loaded = load_policy(tp1_dir)  # written at TP=1
        with torch.no_grad():
            out_loaded = loaded(**_inputs())
        save_policy(_lora_model(seed=21), tp2_dir)  # read back at TP=1 by the test
        local_shape = tuple(loaded.transformer_blocks[0].attn.to_q.lora_B.weight.shape)
    finally:
        parallel_state.destroy_model_parallel()
    return out_loaded, local_shape


def test_checkpoint_saved_at_one_tp_size_loads_at_the_other(tmp_path):
    from leangrpo_mcore.models import load_policy, save_policy

    tp1_model = _lora_model(seed=20)
    save_policy(tp1_model, tmp_path / "tp1")
    with torch.no_grad():
        expected_tp1 = tp1_model(**_inputs())
        expected_tp2 = _lora_model(seed=21)(**_inputs())
    results = run_ranks(_tp2_rank, 2, str(tmp_path / "tp1"), str(tmp_path / "tp2"), timeout=120)
    for out_loaded, local_shape in results:
        assert local_shape == (16, 2)  # the q adapter's B: half of the 32 output rows at TP=2
        assert torch.allclose(out_loaded, expected_tp1, rtol=1e-5, atol=1e-6)
    reloaded = load_policy(tmp_path / "tp2")
    assert reloaded.lora_config.rank == 2
    with torch.no_grad():
        assert torch.allclose(reloaded(**_inputs()), expected_tp2, rtol=1e-5, atol=1e-6)
    full = reloaded.single_transformer_blocks[1].proj_out.weight
    assert torch.equal(full, _lora_model(seed=21).single_transformer_blocks[1].proj_out.weight)
