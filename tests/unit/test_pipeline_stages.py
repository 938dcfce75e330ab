"""Pipeline stages of the FLUX and Wan policies: the block split, the stage's subset of the whole model's
parameters (loaded from the whole model's state dict), and stages chained by hand in one process against the
whole model: forward output and every parameter's gradient (fp32, with LoRA adapters attached)."""

import pytest
import torch

from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, get_family
from leangrpo_mcore.models.common.pipeline import PipelineStage, split_blocks
from tests.unit.test_flux_model import TINY as FLUX_TINY, flux_inputs

TOL = 1e-6
# 2 double + 2 single blocks: splits inside the double blocks, at the double/single boundary, inside the singles.
FLUX = {"family": "flux", **FLUX_TINY, "num_layers": 2, "num_single_layers": 2}
WAN = {"preset": "tiny", "family": "wan", "num_layers": 3}


# ----------------------------------------------------------------------------------------------- the split
def test_even_split_gives_the_remainder_to_the_first_stages():
    stages = split_blocks(10, 4)
    assert [(s.start, s.stop) for s in stages] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [(s.pre_process, s.post_process) for s in stages] == [(True, False), (False, False), (False, False),
                                                                  (False, True)]
    assert [list(s.blocks) for s in split_blocks(4, 2)] == [[0, 1], [2, 3]]
    (whole,) = split_blocks(5, 1)
    assert whole == PipelineStage.whole(5) and whole.pre_process and whole.post_process and whole.is_whole


def test_split_as_given_and_local_block_ranges():
    first, second = split_blocks(57, 2, sizes=[20, 37])
    assert (first.start, first.stop, second.start, second.stop) == (0, 20, 20, 57)
    # FLUX.1-dev: 19 double blocks, then 38 single ones.
    assert first.owned(0, 19) == range(0, 19) and first.owned(19, 38) == range(0, 1)
    assert second.owned(0, 19) == range(0, 0) and second.owned(19, 38) == range(1, 38)


@pytest.mark.parametrize("total, pp, sizes, message", [
    (3, 4, None, "cannot split 3 blocks over 4 pipeline stages"),
    (4, 0, None, "at least 1"),
    (4, 2, [1, 2], r"\[1, 2\] must be 2 positive block counts summing to 4"),
    (4, 2, [4, 0], "positive block counts"),
    (4, 3, [2, 2], "must be 3 positive"),
])
def test_impossible_splits_are_one_line_errors(total, pp, sizes, message):
    with pytest.raises(ValueError, match=message) as err:
        split_blocks(total, pp, sizes)
    assert "\n" not in str(err.value)


def test_a_stage_must_split_the_models_blocks():
    with pytest.raises(ValueError, match="splits 5 blocks, the FLUX model has 4"):
        build_policy(FLUX, stage=split_blocks(5, 2)[0])
    with pytest.raises(ValueError, match="splits 2 blocks, the Wan model has 3"):
        build_policy(WAN, stage=split_blocks(2, 2)[1])


# ----------------------------------------------------------------------------------------------- helpers
def _with_lora(model, family: str, extra: tuple[str, ...] = ()):
    targets = get_family(family).lora_targets + extra
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets=targets), seed=5,
               require_match=model.stage.is_whole)
    return model


def _perturb(model, seed: int):
    """Every tensor non-trivial (adaLN-zero gates and LoRA B start at zero), seeded per name."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + ("norm" in name and "linear" not in name))
    return model


def _stages(model_config, family, sizes, whole, extra=()):
    """The stages of ``sizes`` blocks, each loading its subset of ``whole``'s state dict strictly."""
    full = whole.state_dict()
    stages = []
    for stage in split_blocks(whole.config.num_layers, len(sizes), sizes):
        model = _with_lora(build_policy(model_config, seed=99, stage=stage), family, extra)
        keys = set(model.state_dict())
        assert keys <= set(full)
        model.load_state_dict({k: full[k] for k in keys}, strict=True)
        stages.append(model)
    owned = [set(m.state_dict()) for m in stages]
    assert set().union(*owned) == set(full) and sum(map(len, owned)) == len(full)  # a partition of the names
    return stages


def _chain(stages, inputs, probe):
    """Stage 0 -> 1 -> ... by hand, then backward from the last stage, each boundary's gradient handed up."""
    pairs, received = [], None
    for model in stages:
        if received is not None:
            model.set_input_tensor([received])  # megatron's schedules pass a one-element list
        out = model(**inputs)
        pairs.append((received, out))
        received = out.detach().requires_grad_(True)
    grad = probe
    for received, out in reversed(pairs):
        torch.autograd.backward(out, grad)
        grad = None if received is None else received.grad
    return pairs[-1][1].detach()


def _compare(whole, stages, inputs):
    out = whole(**inputs)
    probe = torch.linspace(-1, 1, out.numel()).view_as(out)
    torch.autograd.backward(out, probe)
    chained = _chain(stages, inputs, probe)
    grads = {name: p.grad for name, p in whole.named_parameters()}
    out_err = ((chained - out).abs().max() / out.abs().max()).item()
    grad_err, checked = 0.0, 0
    for model in stages:
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            ref = grads[name]
            grad_err = max(grad_err, ((param.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
            checked += 1
    return out_err, grad_err, checked


# ----------------------------------------------------------------------------------------------- FLUX
def _flux_whole():
    return _perturb(_with_lora(build_policy(FLUX, seed=3), "flux", ("proj_mlp", "proj_out")), 11)


@pytest.mark.parametrize("sizes", [
    (2, 2),     # at the double/single boundary
    (1, 3),     # inside the double blocks
    (3, 1),     # inside the single blocks
    (1, 1, 2),  # inside the double blocks and at the boundary
])
def test_flux_stages_chained_equal_the_whole_model(sizes):
    whole = _flux_whole()
    stages = _stages(FLUX, "flux", sizes, whole, ("proj_mlp", "proj_out"))
    first, last = stages[0], stages[-1]
    assert hasattr(first, "time_text_embed") and not hasattr(first, "proj_out")
    assert not hasattr(last, "x_embedder") and hasattr(last, "norm_out")
    assert len(first.transformer_blocks) + len(first.single_transformer_blocks) == sizes[0]
    out_err, grad_err, checked = _compare(whole, stages, flux_inputs(4, 4, 6))
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)
    assert checked == len(list(whole.parameters())) > 100


def test_flux_boundary_is_temb_then_text_then_image():
    whole = _flux_whole()
    first = _stages(FLUX, "flux", (1, 3), whole, ("proj_mlp", "proj_out"))[0]
    inputs = flux_inputs(4, 2, 5)
    with torch.no_grad():
        boundary = first(**inputs)
        temb = whole.time_text_embed(inputs["timestep"] * 1000, inputs["guidance"] * 1000,
                                     inputs["pooled_projections"])
    assert boundary.shape == (2, 1 + 5 + 8, 32)
    assert torch.equal(boundary[:, 0], temb)


def test_flux_stage_needs_its_input_tensor():
    second = build_policy(FLUX, stage=split_blocks(4, 2, sizes=[1, 3])[1])
    inputs = flux_inputs(4, 4, 6)
    with pytest.raises(ValueError, match="stage 1 of 2 needs the previous stage's output"):
        second(**inputs)
    second.set_input_tensor(torch.zeros(2, 1 + 6 + 15, 32))
    with pytest.raises(ValueError, match=r"expected a boundary tensor of shape \(2, 23, 32\) from stage 0"):
        second(**inputs)
    assert [name for name, _ in second.named_children()] == ["transformer_blocks", "single_transformer_blocks",
                                                             "norm_out", "proj_out"]
    assert second.transformer_blocks[1] is second.blocks()[0] and len(second.single_transformer_blocks) == 2
    with pytest.raises(IndexError, match=r"block 0 is not held here \(held: 1\)"):
        second.transformer_blocks[0]


# ----------------------------------------------------------------------------------------------- Wan
def _wan_inputs(per_token: bool):
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 4, 5, 8, 6, generator=gen)
    seq = 5 * 4 * 3
    timestep = torch.rand(2, seq, generator=gen) * 1000 if per_token else torch.tensor([937.0, 12.5])
    return dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=torch.randn(2, 7, 16, generator=gen))


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)])
@pytest.mark.parametrize("per_token", [False, True])
def test_wan_stages_chained_equal_the_whole_model(sizes, per_token):
    whole = _perturb(_with_lora(build_policy(WAN, seed=3), "wan"), 13)
    stages = _stages(WAN, "wan", sizes, whole)
    assert hasattr(stages[0], "condition_embedder") and not hasattr(stages[0], "scale_shift_table")
    assert not hasattr(stages[1], "patch_embedding") and hasattr(stages[1], "scale_shift_table")
    assert [len(m.layers) for m in stages] == list(sizes) and stages[1].blocks()[0] is stages[1].layers[sizes[0]]
    out_err, grad_err, checked = _compare(whole, stages, _wan_inputs(per_token))
    assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)
    assert checked == len(list(whole.parameters())) > 60


@pytest.mark.parametrize("per_token, rows", [(False, 60 + 7 + 7), (True, 60 + 7 * 60 + 7)])
def test_wan_boundary_carries_hidden_temb_modulation_and_text(per_token, rows):
    whole = _perturb(_with_lora(build_policy(WAN, seed=3), "wan"), 13)
    first = _stages(WAN, "wan", (1, 2), whole)[0]
    inputs = _wan_inputs(per_token)
    with torch.no_grad():
        boundary = first(**inputs)
        temb, modulation, context, _ = whole.condition_embedder(inputs["timestep"], inputs["encoder_hidden_states"])
    assert boundary.shape == (2, rows, 24)
    tokens = 1 if not per_token else 60
    assert torch.equal(boundary[:, 60:60 + tokens], temb.reshape(2, tokens, 24))
    assert torch.equal(boundary[:, 60 + tokens:rows - 7], modulation.reshape(2, 6 * tokens, 24))
    assert torch.equal(boundary[:, rows - 7:], context)


# ----------------------------------------------------------------------------------------------- checkpoints
def test_each_stage_loads_its_subset_of_a_whole_model_checkpoint(tmp_path):
    from leangrpo_mcore.models import load_policy, save_policy

    whole = _flux_whole()
    save_policy(whole, tmp_path / "ours")
    full = whole.state_dict()
    names = []
    for stage in split_blocks(4, 3, sizes=[1, 1, 2]):
        model = load_policy(tmp_path / "ours", backend="local", stage=stage)
        assert model.lora_config == whole.lora_config
        names.extend(model.state_dict())
        for name, param in model.named_parameters():
            assert torch.equal(param, full[name]), name
    assert sorted(names) == sorted(full)
