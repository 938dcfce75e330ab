"""Wan image-to-video through ``leangrpo-train`` on 2 gloo ranks (one spawn): the tiny TI2V-layout config trains
with each prompt's image in place of the first latent frame (the sampler draws the frames after it, the decoded
videos start from it), writes [source | result] samples and an evaluation on the test split's images; a
channel-concatenated two-expert checkpoint (Wan2.2-I2V-A14B's layout) trains, and so does the CLIP-token one
(Wan2.1-I2V's layout) with its image encoder; that one without an encoder and an I2V checkpoint without images are
one error line each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_ranks, train_capturing
from tests.once import once_per_process

pytestmark = pytest.mark.distributed
pytest.importorskip("nvidia.dali", reason="DALI (nvidia-dali-cuda120, in the 'dali' and 'test' extras) is not installed")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "yaml_configs" / "tiny" / "wan_ti2v_i2v.yaml")




def _runs(rank: int, world_size: int, root: str) -> dict:
    from leangrpo_mcore.engine import build

    torch.set_num_threads(1)
    shapes = []
    real = build.build_engine
    build.build_engine = lambda *a, **k: shapes.append(real(*a, **k)) or shapes[-1]
    data = f"data.prompts={root}/demo/data"
    try:
        out = {"ti2v": train_capturing(["--config", CONFIG, data, f"train.output_dir={root}/ti2v"])}
        out["latent_shape"] = shapes[0].plan.latent_shape
        out["concat"] = train_capturing(["--config", CONFIG, data, "model.preset=wan-tiny-i2v-a14b", "train.max_steps=1",
                                         "eval.every=0", "logging.sample_every=0", f"train.output_dir={root}/concat"])
        out["clip"] = train_capturing(["--config", CONFIG, data, "model.preset=wan-tiny-i2v",
                                       f"train.output_dir={root}/clip"])
        out["clip_trains"] = train_capturing(["--config", CONFIG, data, "model.preset=wan-tiny-i2v", "train.max_steps=1",
                                              f"model.image_encoder_path={root}/clip_encoder", "logging.sample_every=0",
                                              "eval.every=1", f"train.output_dir={root}/clip_trains"])
        out["no_images"] = train_capturing(["--config", CONFIG, data, "model.preset=wan-tiny-i2v-a14b",
                                            "data.images=false", f"train.output_dir={root}/no_images"])
    finally:
        build.build_engine = real
    return out


@pytest.fixture(scope="module")
@once_per_process
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    done = subprocess.run([sys.executable, "tools/make_edit_demo.py", str(root / "demo")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    _save_clip(root / "clip_encoder")
    return root, run_ranks(_runs, 2, str(root), timeout=540)


def _save_clip(root: Path) -> None:
    """A tiny random CLIP image encoder of width 20 (wan-tiny-i2v's image_dim) in a pipeline's layout."""
    import transformers

    torch.manual_seed(5)
    config = transformers.CLIPVisionConfig(hidden_size=20, intermediate_size=37, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=32, patch_size=8)
    transformers.CLIPVisionModel(config).save_pretrained(str(root / "image_encoder"))
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
                                       ).save_pretrained(str(root / "image_processor"))


def test_first_frame_image_to_video_trains_with_samples_and_evaluation(runs):
    import imageio.v3 as iio

    root, ranks = runs
    for out in ranks:
        assert out["ti2v"] == (0, [], False)
        assert out["latent_shape"] == (4, 1, 4, 4)  # 5 frames = the image's latent frame + 1 generated one
    metrics = [json.loads(line) for line in (root / "ti2v" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward_mean"] == m["reward_mean"] for m in metrics)
    evaluation = [json.loads(line) for line in (root / "ti2v" / "eval.jsonl").read_text().splitlines()]
    assert evaluation and evaluation[-1]["num_prompts"] == 2
    # the sample videos decode both latent frames (1 + 4 pixel frames): the image's frame leads each video
    assert iio.imread(root / "ti2v" / "samples" / "step_2.mp4").shape[0] == 5
    assert (root / "ti2v" / "samples" / "eval_step_2.png").is_file()


def test_channel_concatenated_checkpoints_train_and_the_rest_is_one_line(runs):
    root, ranks = runs
    assert all(out["concat"] == (0, [], False) for out in ranks)
    assert all(out["clip_trains"] == (0, [], False) for out in ranks)
    evaluation = [json.loads(line) for line in (root / "clip_trains" / "eval.jsonl").read_text().splitlines()]
    assert evaluation and evaluation[-1]["num_prompts"] == 2
    for name, message in (("clip", "CLIP image tokens"), ("no_images", "set data.images=true")):
        assert all(out[name][0] == 2 and not out[name][2] for out in ranks), name
        errors = [line for out in ranks for line in out[name][1]]  # the job prints its error once
        assert len(errors) == 1 and message in errors[0], (name, errors)
