"""Two experts through ``leangrpo-train``: a pipeline root with transformer/ and transformer_2/ trains one expert,
its training checkpoint resumes bit-identically and exports back to a pipeline root in which the frozen expert is
the original one bit for bit; bad combinations are one error line."""

import json
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from leangrpo_mcore.cli.convert import main as convert_main
from leangrpo_mcore.cli.train import main as train_main
from tests.unit.test_wan_experts import _diffusers_expert
from tests.once import once_per_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY_WAN = str(ROOT / "yaml_configs" / "tiny" / "wan.yaml")
QUIET = ("checkpoint.save_every=1", "logging.progress_bar=false", "logging.tensorboard=false")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(scope="module")
@once_per_process
def pipeline_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("a14b_train") / "pipe"
    WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                transformer=_diffusers_expert(1), transformer_2=_diffusers_expert(2),
                boundary_ratio=0.875).save_pretrained(str(root))
    return root


def _train(out: Path, root: Path, *overrides: str) -> int:
    return train_main(["--config", TINY_WAN, f"model.path={root}", f"train.output_dir={out}", *QUIET, *overrides])


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_one_expert_resume_and_export(pipeline_root, tmp_path):
    # the DanceGRPO schedule's timesteps are 1000, 900 | 750, 500: the high-noise expert runs steps 0 and 1
    args = ("model.experts.train=high", "grpo.timestep_fraction=1.0")
    assert _train(tmp_path / "whole", pipeline_root, *args, "train.max_steps=2") == 0
    assert _train(tmp_path / "cut", pipeline_root, *args, "train.max_steps=1") == 0
    assert _train(tmp_path / "cut", pipeline_root, *args, "train.max_steps=2", "checkpoint.resume=auto") == 0
    whole, cut = _metrics(tmp_path / "whole"), _metrics(tmp_path / "cut")
    assert [m["loss"] for m in whole] == [m["loss"] for m in cut] and len(whole) == 2
    assert [m["reward_mean"] for m in whole] == [m["reward_mean"] for m in cut]
    export = tmp_path / "export"
    argv = ["mcore-to-diffusers", "--src", str(tmp_path / "whole" / "checkpoints" / "step_2"), "--dst", str(export)]
    assert convert_main(argv) == 0
    index = json.loads((export / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["_class_name"] == "WanPipeline"
    original = {c: WanTransformer3DModel.from_pretrained(str(pipeline_root / c)).state_dict()
                for c in ("transformer", "transformer_2")}
    trained = {c: WanTransformer3DModel.from_pretrained(str(export / c)).state_dict()
               for c in ("transformer", "transformer_2")}
    assert all(torch.equal(trained["transformer_2"][k], v) for k, v in original["transformer_2"].items())
    moved = [k for k, v in original["transformer"].items() if not torch.equal(trained["transformer"][k], v)]
    assert len(moved) > len(original["transformer"]) // 2


def test_bad_expert_settings_are_one_line(pipeline_root, tmp_path, capsys):
    cases = [
        (("model.experts.train=high",), "needs a two-expert policy", TINY_WAN, None),
        # DanceGRPO selection never trains the last step: the low-noise expert's steps here are 2 and 3, with
        # fraction 0.6 only one of steps 0-2 is drawn, and a flow_grpo selection of the first step is all high
        (("model.experts.train=low", "grpo.timestep_selection=flow_grpo", "grpo.timestep_fraction=0.3"),
         "runs the low-noise expert", TINY_WAN, pipeline_root),
        (("model.experts.train=sideways",), "model.experts.train", TINY_WAN, pipeline_root),
    ]
    for overrides, message, config, root in cases:
        argv = ["--config", config, f"train.output_dir={tmp_path / 'bad'}", *QUIET, *overrides]
        if root is not None:
            argv.append(f"model.path={root}")
        assert train_main(argv) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err and message in errors[0], err


def test_lora_on_both_experts_exports_merged_or_per_component(tmp_path):
    from safetensors.torch import load_file

    from leangrpo_mcore.models import LoRAConfig, apply_lora, build_policy, merge_lora, save_policy
    from leangrpo_mcore.models.wan import mcore_to_diffusers

    policy = build_policy({"family": "wan", "preset": "wan-tiny-a14b"}, seed=1, backend="local")
    apply_lora(policy, LoRAConfig(rank=2, alpha=4.0, targets=("to_q", "to_v")), seed=0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    save_policy(policy, tmp_path / "ours")
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "kept"),
                         "--keep-lora"]) == 0
    for component, expert in (("transformer", "high"), ("transformer_2", "low")):
        adapters = load_file(str(tmp_path / "kept" / component / "pytorch_lora_weights.safetensors"))
        assert adapters and all(k.startswith("transformer.blocks.") for k in adapters)
        ours = dict(policy.named_parameters())
        a = adapters["transformer.blocks.1.attn2.to_v.lora_A.weight"]
        assert torch.equal(a, ours[f"{expert}.layers.1.attn2.to_v.lora_A.weight"])
    assert convert_main(["mcore-to-diffusers", "--src", str(tmp_path / "ours"), "--dst", str(tmp_path / "merged")]) == 0
    merge_lora(policy)
    expected = mcore_to_diffusers({k: v.detach() for k, v in policy.named_parameters() if "lora_" not in k},
                                  policy.config)
    for component in ("transformer", "transformer_2"):
        merged = WanTransformer3DModel.from_pretrained(str(tmp_path / "merged" / component)).state_dict()
        assert all(torch.allclose(merged[k], expected[f"{component}.{k}"], rtol=0, atol=1e-6) for k in merged)
