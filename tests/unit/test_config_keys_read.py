"""No dead options: every config key is read by the package, a removed key says why it is gone, and the keys that
used to be dropped on the floor (text length, negative prompt) reach the text encoder and the planner."""

import ast
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.config import ConfigError, load_config, valid_keys
from leangrpo_mcore.data.conditioning import HashedTextEncoder, TextDims
from leangrpo_mcore.data.embedding_cache import write_embedding_cache
from leangrpo_mcore.data.prompts import PromptDataset
from leangrpo_mcore.engine import build
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.layout import workload_from_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "leangrpo_mcore"
TINY_WAN = str(ROOT / "yaml_configs" / "tiny" / "wan.yaml")
NOT_YET_READ: set[str] = set()
"""Accepted keys whose reader lands in a separate change (none); remove an entry when its key is read."""


def _names_read() -> set[str]:
    """Attribute names read anywhere in the package outside the config package (``x.name``, getattr(x, "name"))."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def test_every_config_key_is_read_somewhere():
    read = _names_read()
    unread = sorted(k for k in valid_keys() if k.split(".")[-1] not in read and k not in NOT_YET_READ)
    assert not unread, f"config keys that nothing reads: {unread}"


def test_a_removed_key_says_why(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("data:\n  prompts: builtin\n  image_backend: auto\n")
    with pytest.raises(ConfigError, match=r"'data.image_backend' was removed: the images reach the reward as "
                                          r"decoded tensors"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^command line: 'data.image_backend' was removed"):
        load_config(None, ["data.image_backend=pil"])


def test_text_length_and_negative_prompt_reach_the_text_encoder(tmp_path):
    family, hyper = build.policy_hyper(load_config(TINY_WAN))
    dims = TextDims.for_policy("wan", hyper, max_length=7)
    hashed = HashedTextEncoder("wan", dims, seed=3)
    prompts = PromptDataset.from_source("builtin").prompts
    write_embedding_cache(hashed, [*prompts, "blurry, low quality"], tmp_path / "cache")
    overrides = ["model.text_encoder=precomputed", f"model.text_encoder_path={tmp_path / 'cache'}",
                 "sampler.negative_prompt='blurry, low quality'"]
    with pytest.raises(UserError, match="embedding cache"):  # written for 7 tokens, asked for the default 512
        build.build_data_parts(load_config(TINY_WAN, overrides), family, hyper, torch.device("cpu"))
    config = load_config(TINY_WAN, [*overrides, "model.text_max_length=7"])
    parts = build.build_data_parts(config, family, hyper, torch.device("cpu"))
    cond = parts.text_encoder.encode(prompts[:2])
    assert cond.encoder_hidden_states.shape[1] == 7
    negative = hashed.embed(["blurry, low quality"])[0][0]
    assert torch.equal(cond.negative_encoder_hidden_states[0], negative)
    assert torch.equal(cond.negative_encoder_hidden_states[1], negative)


def test_the_planner_counts_the_configured_text_length():
    config = load_config(TINY_WAN, ["model.text_encoder=diffusers", "model.text_max_length=77"])
    assert workload_from_config(config).tokens["text"] == 77
    assert workload_from_config(load_config(TINY_WAN)).tokens["text"] == 16  # the hashed encoder's length
