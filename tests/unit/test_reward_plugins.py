"""Reward plugins: ``package.module:callable`` specs and the ``leangrpo_mcore.rewards`` entry-point group.

Each test writes a user module into its own ``tmp_path`` and puts that folder on ``sys.path``, as a user's
``PYTHONPATH`` would; module names differ per test so that ``sys.modules`` never serves a stale one.
"""

import importlib
import json
import textwrap
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.cli.train import main as train_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.engine.build import _reward
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.rl.rewards import build_reward

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")

PLUGIN_SOURCE = '''
import torch

def brightness(images, prompts):
    return images.mean(dim=(1, 2, 3))

def scaled(images, prompts, *, scale=1.0):
    return scale * images.mean(dim=(1, 2, 3))

def one_argument(images):
    return images.mean(dim=(1, 2, 3))

class PromptLength:
    def __init__(self, weight=1.0):
        self.weight = weight

    def __call__(self, images, prompts):
        return torch.tensor([self.weight * len(p) for p in prompts])

class Exploding:
    def __init__(self):
        raise RuntimeError("no GPU for the reward model\\nsecond line")

class NotCallable:
    pass

THRESHOLD = 0.5
'''


def _module(tmp_path: Path, monkeypatch, name: str, source: str = PLUGIN_SOURCE) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


IMAGES = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.75)])
PROMPTS = ["a cat", "a red bus"]


def test_function_and_class_plugins_score_with_their_options(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_rewards_ok")
    reward = build_reward(f"{mod}:brightness")
    assert reward.name == f"{mod}:brightness"
    assert reward(IMAGES, PROMPTS).tolist() == [0.25, 0.75]
    assert build_reward(f"{mod}:scaled", scale=4.0)(IMAGES, PROMPTS).tolist() == [1.0, 3.0]
    assert build_reward(f"{mod}:PromptLength")(IMAGES, PROMPTS).tolist() == [5.0, 9.0]
    assert build_reward(f"{mod}:PromptLength", weight=0.5)(IMAGES, PROMPTS).tolist() == [2.5, 4.5]
    # Dots after the colon walk attributes: a bound method of a class attribute is a reward too.
    nested = _module(tmp_path, monkeypatch, "user_rewards_nested",
                     "from user_rewards_ok import PromptLength\nclass Holder:\n    scorer = PromptLength(2.0)\n")
    assert build_reward(f"{nested}:Holder.scorer")(IMAGES, PROMPTS).tolist() == [10.0, 18.0]


def test_config_options_reach_plugins_and_builtins(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_rewards_cfg")
    config = load_config(TINY_FLUX, [f"reward.name={mod}:PromptLength", "reward.options={weight: 3}"])
    assert config.reward.options == {"weight": 3}
    assert _reward(config)(IMAGES, PROMPTS).tolist() == [15.0, 27.0]
    low = _reward(load_config(TINY_FLUX, ["reward.options={quality: 10}"]))(IMAGES[:1], PROMPTS[:1])
    high = _reward(load_config(TINY_FLUX, []))(IMAGES[:1], PROMPTS[:1])
    assert low.item() > high.item()  # -(size in kB): quality 10 compresses to fewer bytes than 95
    with pytest.raises(UserError, match=r"reward 'jpeg_compressibility': bad options \['qualty'\]"):
        _reward(load_config(TINY_FLUX, ["reward.options={qualty: 10}"]))
    with pytest.raises(UserError, match="reward.options.url repeats reward.url"):
        _reward(load_config(TINY_FLUX, ["reward.name=remote", "reward.url=http://127.0.0.1:1/",
                                        "reward.options={url: 'http://127.0.0.1:2/'}"]))


@pytest.mark.parametrize("attr, message", [
    ("missing_mod_xyz:fn", "reward 'missing_mod_xyz:fn': cannot import module 'missing_mod_xyz': "
                           "ModuleNotFoundError: No module named 'missing_mod_xyz'"),
    ("{mod}:nothing_here", "reward '{mod}:nothing_here': module '{mod}' has no attribute 'nothing_here'"),
    ("{mod}:THRESHOLD", "reward '{mod}:THRESHOLD': float object is not callable"),
    ("{mod}:one_argument", "reward '{mod}:one_argument' must be callable as (images, prompts); "
                           "its signature is (images)"),
    ("{mod}:Exploding", "reward '{mod}:Exploding': Exploding(...) raised RuntimeError: no GPU for the reward "
                        "model second line"),
    ("{mod}:NotCallable", "reward '{mod}:NotCallable': instances of NotCallable are not callable"),
    ("{mod}:", "a plugin reward is named package.module:callable"),
    # the list goes on with every registered name (tests register their own in the same process)
    ("not_a_reward", "unknown reward 'not_a_reward'; valid: aesthetic, clip_consistency, clip_score, "),
])
def test_bad_plugins_are_one_line_errors(tmp_path, monkeypatch, attr, message):
    mod = _module(tmp_path, monkeypatch, "user_rewards_bad")
    with pytest.raises(UserError) as info:
        build_reward(attr.format(mod=mod))
    text = str(info.value)
    assert "\n" not in text and message.format(mod=mod) in text, text


def test_options_a_callable_does_not_take_are_refused(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_rewards_opts")
    with pytest.raises(UserError, match=rf"reward '{mod}:brightness': bad options \['scale'\]"):
        build_reward(f"{mod}:brightness", scale=2.0)
    with pytest.raises(UserError, match=rf"reward '{mod}:PromptLength': bad options \['bias'\]"):
        build_reward(f"{mod}:PromptLength", bias=1.0)


def test_modules_that_fail_to_import_are_one_line(tmp_path, monkeypatch):
    syntax = _module(tmp_path, monkeypatch, "user_rewards_syntax", "def broken(:\n    pass\n")
    with pytest.raises(UserError, match=rf"cannot import module '{syntax}': SyntaxError: "):
        build_reward(f"{syntax}:broken")
    raising = _module(tmp_path, monkeypatch, "user_rewards_raising", "import no_such_dependency_abc\n")
    with pytest.raises(UserError, match=rf"cannot import module '{raising}': ModuleNotFoundError: No module named "
                                        "'no_such_dependency_abc'"):
        build_reward(f"{raising}:fn")


def _install_entry_point(tmp_path: Path, monkeypatch, name: str, value: str) -> None:
    """A minimal installed distribution: a dist-info folder with METADATA and entry_points.txt on sys.path."""
    info = tmp_path / "user_reward_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: user-reward-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[leangrpo_mcore.rewards]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_entry_points_are_found_by_name(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_rewards_ep")
    _install_entry_point(tmp_path, monkeypatch, "prompt_length", f"{mod}:PromptLength")
    assert build_reward("prompt_length", weight=2.0)(IMAGES, PROMPTS).tolist() == [10.0, 18.0]
    with pytest.raises(UserError, match="unknown reward 'prompt_lenght'; .*; installed plugins: prompt_length"):
        build_reward("prompt_lenght")


def test_a_broken_entry_point_is_one_line(tmp_path, monkeypatch):
    _install_entry_point(tmp_path, monkeypatch, "gone_reward", "user_rewards_gone_xyz:fn")
    with pytest.raises(UserError, match="reward 'gone_reward': cannot load entry point user_rewards_gone_xyz:fn: "
                                        "ModuleNotFoundError"):
        build_reward("gone_reward")


def test_a_plugin_drives_a_training_run(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "user_rewards_run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = train_main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1",
                           f"reward.name={mod}:scaled", "reward.options={scale: -1.0}"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # -(mean pixel) of images in [0, 1]: strictly between -1 and 0 for the tiny VAE's decodings.
    assert -1.0 < row["reward_mean"] < 0.0 and row["reward_std"] > 0.0
    code = train_main(["--config", TINY_FLUX, f"train.output_dir={tmp_path / 'bad'}", f"reward.name={mod}:brightness",
                       "reward.options={scale: 2}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert f"error: reward '{mod}:brightness': bad options ['scale']" in err
    assert not (tmp_path / "bad").exists()  # refused before the run directory is made
