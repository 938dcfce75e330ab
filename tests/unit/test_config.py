import dataclasses
import subprocess
import sys
import typing

import pytest
import yaml

from leangrpo_mcore.config import Config, ConfigError, dump_config, load_config, valid_keys
from leangrpo_mcore.config.fields import field_docs
from leangrpo_mcore.config.loader import section_type


def _write(path, data):
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _sections(cls=Config):
    hints = typing.get_type_hints(cls)
    yield cls
    for f in dataclasses.fields(cls):
        section = section_type(hints[f.name])
        if section is not None:
            yield from _sections(section)


def test_every_field_has_a_docstring():
    for cls in _sections():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_defaults_inheritance_and_overrides(tmp_path):
    (tmp_path / "base").mkdir()
    _write(tmp_path / "base" / "root.yaml", {"grpo": {"group_size": 8, "clip_range": "1e-5"}, "sampler": {"num_steps": 10}})
    _write(tmp_path / "base" / "mid.yaml", {"defaults": ["root.yaml"], "sampler": {"num_steps": 12, "noise_level": 0.7}})
    _write(tmp_path / "exp.yaml", {"defaults": ["base/mid.yaml"], "grpo": {"kl_beta": 0.04}})
    cfg = load_config(tmp_path / "exp.yaml", ["grpo.clip_range=2e-4", "sampler.sde_window_range=[1, 2]",
                                              "model.lora.rank=16", "checkpoint.resume=null",
                                              "parallel.dp_shard=2", "reward.weights={a: 1, b: 2.5}"])
    assert cfg.grpo.group_size == 8            # from root, through mid
    assert cfg.sampler.num_steps == 12         # mid overrides root
    assert cfg.sampler.noise_level == 0.7
    assert cfg.grpo.kl_beta == 0.04
    assert cfg.grpo.clip_range == 2e-4 and isinstance(cfg.grpo.clip_range, float)
    assert cfg.sampler.sde_window_range == [1, 2]
    assert cfg.model.lora.rank == 16
    assert cfg.checkpoint.resume is None
    assert cfg.parallel.dp_shard == 2 and cfg.parallel.dp_replicate == "auto"
    assert cfg.reward.weights == {"a": 1.0, "b": 2.5}
    assert cfg.sampler.shift == Config().sampler.shift  # untouched keys keep their defaults


def test_yaml_float_without_dot_is_coerced(tmp_path):
    cfg = load_config(_write(tmp_path / "x.yaml", "grpo:\n  clip_range: 1e-5\n  kl_beta: 0\n"))
    assert cfg.grpo.clip_range == 1e-5 and cfg.grpo.kl_beta == 0.0 and isinstance(cfg.grpo.kl_beta, float)


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = _write(tmp_path / "x.yaml", {"grpo": {"clip_rnage": 1e-5}})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: unknown key 'grpo.clip_rnage' (did you mean 'grpo.clip_range'?)"


def test_unknown_key_in_inherited_file_names_that_file(tmp_path):
    base = _write(tmp_path / "base.yaml", {"sampler": {"num_stpes": 3}})
    exp = _write(tmp_path / "exp.yaml", {"defaults": ["base.yaml"], "grpo": {"group_size": 2}})
    with pytest.raises(ConfigError, match=rf"^{base}: unknown key 'sampler.num_stpes' \(did you mean 'sampler.num_steps'\?\)$"):
        load_config(exp)


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.group_size=abc", "command line: 'grpo.group_size' must be int, got str 'abc'"),
        ("grpo.group_size=0", "command line: 'grpo.group_size' = 0 must be >= 1"),
        ("grpo.timestep_fraction=1.5", "command line: 'grpo.timestep_fraction' = 1.5 must be <= 1.0"),
        ("schedule.name=fast", "command line: 'schedule.name' = 'fast' is not one of 'native', 'retain', 'reweight', 'auto'"),
        ("parallel.dp_shard=many", "command line: 'parallel.dp_shard' must be int or 'auto', got str 'many'"),
        ("sampler.same_latent=3", "command line: 'sampler.same_latent' must be bool, got int 3"),
        ("model.lora=3", "command line: 'model.lora' must be a mapping, got int 3"),
        ("grpo.kl_betta=0.1", "command line: unknown key 'grpo.kl_betta' (did you mean 'grpo.kl_beta'?)"),
        ("no_equals_sign", "command line: override 'no_equals_sign' is not of the form dotted.key=value"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=.inf", "'optim.lr' must be a finite number, got inf"),
        ("optim.lr=nan", "'optim.lr' must be a finite number, got nan"),
        ("grpo.kl_beta=-.inf", "'grpo.kl_beta' must be a finite number, got -inf"),
        ("sampler.shift=1e999", "'sampler.shift' must be a finite number, got inf"),  # overflows to inf
        ("optim.betas=[0.9, .nan]", "'optim.betas' must be a finite number, got nan"),
        ("reward.weights={jpeg_compressibility: .inf}", "'reward.weights' must be a finite number, got inf"),
    ],
)
def test_non_finite_floats_are_refused(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == f"command line: {message}"


def test_non_finite_float_in_file(tmp_path):
    path = _write(tmp_path / "x.yaml", "optim:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=rf"^{path}: 'optim.lr' must be a finite number, got inf$"):
        load_config(path)
    assert load_config(None, ["optim.lr=1e-5", "optim.betas=[0.5, 0.75]"]).optim.betas == [0.5, 0.75]


def test_wrong_type_in_file(tmp_path):
    path = _write(tmp_path / "x.yaml", {"optim": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=rf"^{path}: 'optim.lr' must be float, got str 'fast'$"):
        load_config(path)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line \d+\)"):
        load_config(_write(tmp_path / "bad.yaml", "grpo:\n  group_size: [1\n"))
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(_write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, ["grpo.kl_beta=0.01", "model.lora.rank=8", "reward.weights={x: 2}"])
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_valid_keys_cover_nested_sections():
    keys = valid_keys()
    for key in ("train.output_dir", "model.lora.rank", "model.lora.alpha", "grpo.global_std", "parallel.dp_replicate"):
        assert key in keys


def test_cli_prints_one_line_and_exits_2(tmp_path):
    path = _write(tmp_path / "x.yaml", {"grpo": {"clip_rnage": 1}})
    out = subprocess.run([sys.executable, "-m", "leangrpo_mcore.cli.train", "--config", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {path}: unknown key 'grpo.clip_rnage' (did you mean 'grpo.clip_range'?)"
