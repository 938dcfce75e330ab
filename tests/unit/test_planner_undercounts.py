"""The planner charges what the schedules really keep: every group's graphs or provisional gradients under the
global std, one forward and backward per sample under Reweight at any micro-batch, and the provisional gradients
in their own dtype."""

import dataclasses

from leangrpo_mcore.planner.arch_specs import load_arch
from leangrpo_mcore.planner.cost_model import memory_phases, step_time
from leangrpo_mcore.planner.workload import PRECISIONS, GiB, Hardware, Layout, Workload

H100 = Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * GiB, gpu_tflops=989, intra_node_gbps=150,
                hbm_gbps=3350)
LAYOUT = Layout(tp=1, dp_shard=8, dp_replicate=1)  # 8 ranks, groups of 8: one generation per rank per group


def _work(**kw) -> Workload:
    arch = load_arch("flux-dev")
    args = {"num_steps": 16, "selected_steps": 8, "group_size": 8, "prompts_per_step": 4, **kw}
    return Workload(arch=arch, tokens=arch.tokens(512, 512, 1), **args)


def test_retain_keeps_every_groups_graphs_under_the_global_std():
    per_group = memory_phases(_work(), H100, LAYOUT, "retain", False)["retain_graphs"]["activations"]
    every = memory_phases(_work(global_std=True), H100, LAYOUT, "retain", False)["retain_graphs"]["activations"]
    assert every == 4 * per_group  # four groups per rank, all kept until the step's last reward


def test_reweight_keeps_every_provisional_gradient_under_the_global_std_without_the_fold():
    one = memory_phases(_work(), H100, LAYOUT, "reweight", False)["provisional_gradients"]["provisional_grads"]
    kept = memory_phases(_work(global_std=True), H100, LAYOUT, "reweight", False)
    folded = memory_phases(_work(global_std=True, reweight_global_fold=True), H100, LAYOUT, "reweight", False)
    assert kept["provisional_gradients"]["provisional_grads"] == 4 * one
    assert folded["provisional_gradients"]["provisional_grads"] == 2 * one  # + the folded sum


def test_reweight_runs_a_forward_and_a_backward_per_sample_at_any_micro_batch():
    group16 = dict(group_size=16)  # two generations per rank, so a micro-batch of two exists
    single = step_time(_work(**group16), H100, LAYOUT, "reweight", False)
    batched = step_time(_work(micro_batch=2, **group16), H100, LAYOUT, "reweight", False)
    native = step_time(_work(micro_batch=2, **group16), H100, LAYOUT, "native", False)["backward"]
    assert batched["backward"] == single["backward"] > 0 and batched["rollout"] == single["rollout"] > 0
    assert native == single["backward"]  # the same backward work per sample as Native's
    assert native == step_time(_work(**group16), H100, LAYOUT, "native", False)["backward"]
    # one sample's graph at a time, where Native holds the micro-batch's; each per-sample pass gathers
    one = memory_phases(_work(**group16), H100, LAYOUT, "reweight", False)["provisional_gradients"]
    two = memory_phases(_work(micro_batch=2, **group16), H100, LAYOUT, "reweight", False)["provisional_gradients"]
    nat = memory_phases(_work(micro_batch=2, **group16), H100, LAYOUT, "native", False)["native_update"]
    assert two["activations"] == one["activations"] and nat["activations"] == 2 * one["activations"]
    assert batched["fsdp_all_gather"] > single["fsdp_all_gather"] * 0.75  # the trained passes are not batched


def test_provisional_gradients_are_charged_in_their_dtype():
    bf16 = PRECISIONS["bf16"]
    fp32_buffers = dataclasses.replace(bf16, buffer_bytes=4)
    low = memory_phases(_work(precision=bf16), H100, LAYOUT, "reweight", False)
    high = memory_phases(_work(precision=fp32_buffers), H100, LAYOUT, "reweight", False)
    assert (high["provisional_gradients"]["provisional_grads"]
            == 2 * low["provisional_gradients"]["provisional_grads"])


def test_the_reweight_plan_and_its_fallback_are_explained():
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.planner.layout import plan, workload_from_config

    hw = Hardware(nodes=1, gpus_per_node=1)
    fallback = workload_from_config(load_config("yaml_configs/tiny/flux.yaml", [
        "schedule.reweight_accumulate=affine", "grpo.adv_clip_max=0.5"]))
    assert fallback.reweight_accumulate == "per_sample" and "clamp may fire" in fallback.reweight_note
    result = plan(fallback, hw, schedules=("reweight",))
    assert result.schedule == "reweight"
    assert "Reweight accumulates per-sample provisional gradients; |A| can reach 1 > adv_clip_max 0.5" in result.reason
    exact = workload_from_config(load_config("yaml_configs/tiny/flux.yaml", ["schedule.reweight_accumulate=affine"]))
    assert exact.reweight_accumulate == "affine" and not exact.reweight_note
    assert "Reweight accumulates affine provisional gradients." in plan(exact, hw, schedules=("reweight",)).reason


def test_activations_are_charged_per_tensor_parallel_rank():
    """q/k/v, the attention output and the MLP hidden state are split over TP; the block input and its normed and
    modulated copies are not: at TP=4 a rank saves less than a quarter more than a quarter of TP=1's bytes."""
    def saved(tp):
        layout = Layout(tp=tp, dp_shard=8 // tp, dp_replicate=1)
        return memory_phases(_work(), H100, layout, "reweight", False)["provisional_gradients"]["activations"]

    one, four = saved(1), saved(4)
    assert 0.3 < four / one < 0.55, (one, four)


def test_lora_on_the_default_targets_saves_no_input_of_a_frozen_linear():
    from leangrpo_mcore.planner.arch_specs import DEFAULT_LORA_TARGETS

    def saved(**kw):
        return memory_phases(_work(**kw), H100, LAYOUT, "native", False)["native_update"]["activations"]

    full = saved()
    lora = saved(lora_rank=64, lora_targets=DEFAULT_LORA_TARGETS["flux"])
    custom = saved(lora_rank=64, lora_targets=("attn.to_q",))
    assert 0.6 < lora / full < 0.85, (full, lora)  # FLUX's single blocks: MLP and output projection frozen
    assert custom == full  # other targets: charged as full fine-tuning (an upper bound)
