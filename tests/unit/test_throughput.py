"""The FLOP count behind the throughput metrics: a hand count on a tiny FLUX, torch's own FLOP counter on the real
FLUX and Wan policies (full fine-tune and LoRA), the passes of each schedule, and the scalars a training run logs."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from leangrpo_mcore.cli.train import main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.throughput import Throughput, device_peak_tflops, peak_tflops_of
from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.common.lora import LoRAConfig, apply_lora, mark_only_lora_trainable
from leangrpo_mcore.planner.arch_specs import DEFAULT_LORA_TARGETS, flux_spec, wan_spec
from leangrpo_mcore.planner.flops import pass_flops, step_flops, step_flops_for_config, step_passes
from tests.cli_helpers import run_cli
from tests.unit.test_flux_model import TINY, flux_inputs

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"image": 4, "text": 3, "joint": 7, "sample": 1}
ATEN = torch.ops.aten
# torch counts no FLOPs for the CPU flash-attention kernels: its own formulas for the CUDA ones, mapped onto them.
CPU_ATTENTION = {
    ATEN._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    ATEN._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v),
}


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


def mm(tokens, fan_in, fan_out):
    """A linear layer's forward: 2 FLOPs per multiply-add, tokens x in x out of them."""
    return 2 * tokens * fan_in * fan_out


def test_pass_flops_equal_a_hand_count_on_a_tiny_flux():
    # flux-tiny: d = 2 heads x 16 = 32, in 16, text width 32, pooled 24, guidance; 4 image + 3 text = 7 tokens.
    entry = mm(4, 16, 32) + mm(3, 32, 32) + 2 * mm(1, 256, 32) + mm(1, 24, 32)  # read the model's inputs
    root = 3 * mm(1, 32, 32) + mm(1, 32, 64) + mm(4, 32, 16)  # linear_2 x3, norm_out, proj_out
    double = (2 * mm(1, 32, 192) + 4 * mm(4, 32, 32) + 4 * mm(3, 32, 32)  # adaLN x2, q k v out on both streams
              + 2 * mm(4, 32, 128) + 2 * mm(3, 32, 128))  # both MLPs
    single = mm(1, 32, 96) + 3 * mm(7, 32, 32) + mm(7, 32, 128) + mm(7, 160, 32)
    attention = 2 * 2 * (4 * 7 * 7 * 16)  # two blocks, two heads, QK^T and PV over the 7 joint tokens
    spec = flux_spec(TINY)
    full = pass_flops(spec, TOKENS)
    assert full.forward == entry + root + double + single + attention
    assert full.forward_attention == attention
    # Backward: input and weight gradients, only the weight's where nothing upstream needs a gradient; attention
    # 2.5x (four gradient products and the scores again).
    assert full.backward == entry + 2 * (root + double + single) + 2.5 * attention
    assert full.recompute == 0
    checkpointed = pass_flops(spec, TOKENS, checkpointing=True, cfg=True)
    assert checkpointed.recompute == 2 * (double + single + attention)  # the blocks again, both CFG branches
    assert checkpointed.forward == 2 * full.forward and checkpointed.backward == 2 * full.backward
    # LoRA rank 2 on FlowGRPO's targets: q k v out and both MLP linears of both streams, q k v of the single block.
    adapters = 2 * 2 * (4 * 4 * (32 + 32) + 4 * 3 * (32 + 32) + 2 * (32 + 128) * (4 + 3) + 3 * 7 * (32 + 32))
    lora = pass_flops(spec, TOKENS, lora_rank=2, lora_targets=DEFAULT_LORA_TARGETS["flux"])
    assert lora.forward == full.forward + adapters
    assert lora.reference == full.forward  # the KL reference runs without the adapters


def _counted(policy, run):
    """(forward FLOPs, backward FLOPs) torch counts for one forward and one backward of ``run(policy)``."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        out = run(policy)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        out.float().square().sum().backward()
    return forward, counter.get_total_flops()


def _with_lora(policy, family):
    apply_lora(policy, LoRAConfig(rank=2, alpha=2.0, targets=DEFAULT_LORA_TARGETS[family]))
    mark_only_lora_trainable(policy)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_()  # B starts at zero: make every adapter product non-trivial
    return policy


@pytest.mark.parametrize("rank", [0, 2])
def test_pass_flops_equal_torch_flop_counter_on_the_flux_policy(rank):
    policy = build_policy({"family": "flux", **TINY})
    if rank:
        _with_lora(policy, "flux")
    inputs = flux_inputs(2, 2, 3, batch=1)
    forward, backward = _counted(policy, lambda p: p(**inputs))
    flops = pass_flops(flux_spec(TINY), TOKENS, lora_rank=rank, lora_targets=DEFAULT_LORA_TARGETS["flux"])
    assert (flops.forward, flops.backward) == (forward, backward)


@pytest.mark.parametrize("rank", [0, 2])
def test_pass_flops_equal_torch_flop_counter_on_the_wan_policy(rank):
    from leangrpo_mcore.models.wan import PRESETS

    policy = build_policy({"family": "wan", **PRESETS["tiny"]})
    if rank:
        _with_lora(policy, "wan")
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 4, 1, 8, 6, generator=gen), torch.randn(1, 5, 16, generator=gen)
    forward, backward = _counted(policy, lambda p: p(latents, torch.tensor([500.0]), text))
    tokens = {"image": 12, "text": 5, "joint": 17, "sample": 1}  # 8x6 latent pixels in 2x2 patches
    flops = pass_flops(wan_spec(PRESETS["tiny"]), tokens, lora_rank=rank, lora_targets=DEFAULT_LORA_TARGETS["wan"])
    assert (flops.forward, flops.backward) == (forward, backward)


@pytest.mark.parametrize("rank", [0, 2])
def test_pass_flops_equal_torch_flop_counter_on_the_qwen_image_policy(rank):
    from leangrpo_mcore.models.qwen_image import PRESETS
    from leangrpo_mcore.planner.arch_specs import qwen_image_spec

    policy = build_policy({"family": "qwen_image", **PRESETS["qwen-image-tiny"]})
    if rank:
        _with_lora(policy, "qwen_image")
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 4, 64, generator=gen), torch.randn(1, 3, 24, generator=gen)
    # txt_in's input gradient counts in a full fine-tune (txt_norm's weight trains); the last block's idle text
    # MLP and projection count nothing
    forward, backward = _counted(policy, lambda p: p(latents, text, None, torch.tensor([0.5]), (1, 2, 2)))
    flops = pass_flops(qwen_image_spec(PRESETS["qwen-image-tiny"]), TOKENS, lora_rank=rank,
                       lora_targets=DEFAULT_LORA_TARGETS["qwen_image"])
    assert (flops.forward, flops.backward) == (forward, backward)


def test_step_passes_per_schedule():
    # T = 6, |S| = 5: Native rolls out 6 steps without gradients and recomputes 5; the Lean schedules train from 5
    # grad-enabled rollout forwards. KL: a reference forward per trained step, Reweight a second backward.
    assert step_passes("native", num_steps=6, selected_steps=5, kl=False) == {
        "nograd": 6, "rollout_grad": 0, "recompute": 5, "reference": 0, "backward": 5}
    assert step_passes("retain", num_steps=6, selected_steps=5, kl=True) == {
        "nograd": 1, "rollout_grad": 5, "recompute": 0, "reference": 5, "backward": 5}
    assert step_passes("reweight", num_steps=6, selected_steps=5, kl=True) == {
        "nograd": 1, "rollout_grad": 5, "recompute": 0, "reference": 5, "backward": 10}
    assert step_passes("reweight", num_steps=6, selected_steps=5, kl=True, pp=2)["rollout_grad"] == 10
    # Two updates per rollout: the second block of groups (2 prompts x 4 samples) is trained by Native.
    spec = flux_spec(TINY)
    step = step_flops(spec, TOKENS, schedule="reweight", num_steps=6, selected_steps=5, group_size=4,
                      prompts_per_step=4, updates_per_rollout=2)
    assert step.samples == 16
    assert step.counts == {"nograd": 8 * 1 + 8 * 6, "rollout_grad": 8 * 5, "recompute": 8 * 5, "reference": 0,
                           "backward": 16 * 5}
    p = step.passes
    assert step.total == (8 + 48 + 40 + 40) * p.forward + 80 * p.backward
    assert step.per_rank_counts(2)["rollout_grad"] == 20


def test_peak_table_and_setting():
    assert peak_tflops_of("NVIDIA H100 80GB HBM3") == 989 and peak_tflops_of("NVIDIA H200") == 989
    assert peak_tflops_of("NVIDIA H100 PCIe") == 756 and peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312
    assert peak_tflops_of("NVIDIA L40S") == 362 and peak_tflops_of("NVIDIA L4") == 121
    assert peak_tflops_of("Some Accelerator") is None
    assert device_peak_tflops(torch.device("cpu")) is None
    assert device_peak_tflops(torch.device("cpu"), 50.0) == 50.0


def test_scalars_follow_from_the_step_time():
    meter = Throughput(samples_per_step=8, devices=2, flops_per_step=6e12, peak_tflops=1.5)
    assert meter.scalars(4.0) == {"samples_per_s": 2.0, "samples_per_s_per_device": 1.0, "tflops_per_device": 0.75,
                                  "mfu": 0.5}
    assert "mfu" not in Throughput(8, 2, 6e12).scalars(4.0)
    assert Throughput(8, 2).scalars(2.0) == {"samples_per_s": 4.0, "samples_per_s_per_device": 2.0}


def test_training_logs_throughput_of_each_step(capsys, tmp_path):
    config = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")
    run = tmp_path / "run"
    overrides = [f"train.output_dir={run}", "train.max_steps=2", "logging.progress_bar=false",
                 "logging.peak_tflops=0.002", "checkpoint.save_every=0"]
    code, errors, output = run_cli(main, capsys, "--config", config, *overrides)
    assert code == 0 and not errors, output
    assert "throughput: 4 samples and" in output and "mfu against 0.002 TFLOP/s per device" in output
    flops = step_flops_for_config(load_config(config, overrides))
    # tiny flux: 2 prompts x 2 generations, T = 3 with 2 trained steps, Reweight: 4 x (1 + 2) forwards, 4 x 2 backwards
    assert flops.counts == {"nograd": 4, "rollout_grad": 8, "recompute": 0, "reference": 0, "backward": 8}
    p = flops.passes
    total = 12 * p.forward + 8 * p.backward
    for row in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()):
        seconds = row["time_step_s"]
        assert row["samples_per_s"] == pytest.approx(4 / seconds)
        assert row["samples_per_s_per_device"] == pytest.approx(4 / seconds)
        assert row["tflops_per_device"] == pytest.approx(total / seconds / 1e12)
        assert row["mfu"] == pytest.approx(total / seconds / 1e12 / 0.002)


SMOKE_EVERYTHING = ["model.lora.rank=2", "grpo.kl_beta=0.1", "model.activation_checkpointing=true",
                    "grpo.prompts_per_step=2", "grpo.updates_per_rollout=2"]


@pytest.mark.slow
@pytest.mark.parametrize("config, overrides", [("yaml_configs/bench/smoke.yaml", SMOKE_EVERYTHING),
                                               ("yaml_configs/tiny/wan.yaml", [])])
def test_step_flops_equal_torch_flop_counter_over_whole_steps(config, overrides):
    """LoRA, the KL reference, activation checkpointing and a second (Native) update on FLUX; two-branch CFG and
    DanceGRPO selection on Wan: every matmul and attention of a real step of each schedule, as torch counts them."""
    from leangrpo_mcore.bench.runner import Bench, BenchOptions
    from leangrpo_mcore.engine.launch import DistContext

    cfg = load_config(str(ROOT / config), overrides)
    options = BenchOptions(schedules=("native", "retain", "reweight"), steps=1, warmup=0, measure_memory=False)
    bench = Bench(cfg, options, DistContext(0, 1, 0, torch.device("cpu"), "gloo", False))
    inputs = bench.inputs(0)
    policy = type(bench.main.parts.policy).__name__  # the counts inside the policy: the reward's VAE decode is not
    for label in options.schedules:
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            bench.step(label, inputs)
        counted = sum(counter.get_flop_counts()[policy].values())
        assert counted == step_flops_for_config(cfg, label).total, label


@pytest.mark.slow
def test_qwen_image_step_flops_follow_the_trimmed_text():
    """The tiny Qwen-Image's prompts are trimmed per step (padding masked): a whole step of each schedule, true CFG
    included, counts what torch counts at the step's text length, and the logged throughput uses that length."""
    from leangrpo_mcore.bench.runner import Bench, BenchOptions
    from leangrpo_mcore.engine.launch import DistContext
    from leangrpo_mcore.engine.throughput import step_throughput

    cfg = load_config(str(ROOT / "yaml_configs" / "tiny" / "qwen_image.yaml"))
    options = BenchOptions(schedules=("native", "reweight"), steps=1, warmup=0, measure_memory=False)
    bench = Bench(cfg, options, DistContext(0, 1, 0, torch.device("cpu"), "gloo", False))
    inputs = bench.inputs(0)
    text = inputs.conditioning.encoder_hidden_states.shape[1]
    assert text < 16 and inputs.conditioning.encoder_attention_mask is not None  # trimmed, padding masked
    policy = type(bench.main.parts.policy).__name__
    for label in options.schedules:
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
            bench.step(label, inputs)
        counted = sum(counter.get_flop_counts()[policy].values())
        assert counted == step_flops_for_config(cfg, label, text_tokens=text).total, label
        throughput = step_throughput(cfg, label, 1, torch.device("cpu"))
        tflops = throughput.scalars(1.0, text_tokens=text)["tflops_per_device"]
        assert tflops * 1e12 == counted < throughput.flops_per_step
