"""Load YAML experiment configs into :class:`~leangrpo_mcore.config.schema.Config`.

- ``defaults: [base.yaml, ...]`` inherits from other files (paths relative to the including file), applied in
  order, then the file's own keys on top (mappings merge, everything else replaces).
- ``dotted.key=value`` overrides are parsed as YAML scalars / lists / null and coerced to the field's type.
- Strict: an unknown key, a wrong type, a non-finite float or an out-of-range value raises :class:`ConfigError`, whose one-line
  message names the file (or ``command line``), the dotted key and, for unknown keys, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from leangrpo_mcore.config.fields import range_error
from leangrpo_mcore.config.window_rules import window_error
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.config.schema import Config

COMMAND_LINE = "command line"
REMOVED_KEYS = {
    "data.image_backend": "the images reach the reward as decoded tensors, and conditioning image files "
                          "(data.images) are always read by DALI; delete the key (resolved configs of earlier runs "
                          "hold it)",
}
"""Keys that earlier versions accepted, with why they are gone: a config holding one gets that reason."""


class ConfigError(UserError):
    """A bad config: the message is one line naming the source and the dotted key."""


class NonFiniteError(TypeError):
    """A float field holds inf or nan (no option of the config accepts them)."""


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (with its ``defaults:``), apply ``overrides`` and return the checked :class:`Config`."""
    data: dict = {}
    sources: dict[str, str] = {}
    if path is not None:
        data, sources = _read_with_defaults(os.fspath(path), chain=())
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(data, sources, key, value, COMMAND_LINE)
    return build_config(data, sources)


def build_config(data: dict, sources: dict[str, str] | None = None) -> Config:
    """Turn a nested mapping into a checked :class:`Config` (``sources`` maps dotted keys to their file)."""
    config = _build(Config, data, prefix="", sources=sources or {}, default_source="<dict>")
    _check_combinations(config, sources or {})
    return config


NOISELESS_SDE_KINDS = ("wan",)
"""SDE kinds whose step sets its own noise and ignores ``sampler.noise_level``."""


def _check_combinations(config: Config, sources: dict) -> None:
    """ConfigError for values that are each in range but cannot work together."""
    s = config.sampler
    if s.noise_level == 0 and s.sde_kind not in NOISELESS_SDE_KINDS:
        source = sources.get("sampler.noise_level", sources.get("sampler", "<dict>"))
        raise ConfigError(f"{source}: 'sampler.noise_level' = 0 leaves sampler.sde_kind={s.sde_kind} no noise, and "
                          f"GRPO needs stochastic rollouts; set it > 0 (the deterministic ODE rollout is "
                          f"evaluation's: eval.noise_level: 0)")
    low, high = (list(s.sde_window_range) + [0, 0])[:2]
    error = window_error(size=s.sde_window_size, low=low, high=high, schedule=s.sde_window_schedule,
                         stride=s.window_stride, shift_every=s.window_shift_every,
                         ode_steps_after=s.ode_steps_after_window, ode_solver=s.ode_solver, num_steps=s.num_steps,
                         ode_solver_before=s.ode_solver_before_window)
    if error is not None:
        raise ConfigError(error)
    g = config.grpo
    if s.sde_kind == "flow_grpo_cps" and (g.ratio_norm or g.grad_reweight != "none"):
        key = "grpo.ratio_norm" if g.ratio_norm else f"grpo.grad_reweight={g.grad_reweight}"
        raise ConfigError(f"{key} needs a Gaussian SDE step with its normalised log-density: "
                          f"sampler.sde_kind=flow_grpo_cps drops it (use flow_grpo, wan or dance_grpo)")


def build_section(cls: type, data: Any, prefix: str) -> Any:
    """A checked section dataclass ``cls`` from a mapping found under the dotted ``prefix`` (e.g. an entry of a
    list of sections such as ``eval.rewards``)."""
    return _build(cls, data, prefix=prefix, sources={}, default_source="config")


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the fully resolved config as YAML (loadable again by :func:`load_config`)."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(config_to_yaml(config))


def config_to_yaml(config: Config) -> str:
    """The resolved config as a YAML document."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False, default_flow_style=None)


def section_type(tp: Any) -> type | None:
    """The dataclass of a config section annotated ``Section`` or ``Optional[Section]``, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        members = [m for m in get_args(tp) if m is not type(None)]
        if len(members) == 1 and dataclasses.is_dataclass(members[0]):
            return members[0]
    return None


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections included."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        keys.append(dotted)
        section = section_type(hints[f.name])
        if section is not None:
            keys.extend(valid_keys(section, dotted + "."))
    return keys


def _read_with_defaults(path: str, chain: tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    real = os.path.realpath(path)
    if real in chain:
        raise ConfigError(f"{path}: circular 'defaults' chain")
    if not os.path.isfile(path):
        where = f"{chain[-1]}: " if chain else ""
        raise ConfigError(f"{where}config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: {getattr(err, 'problem', err)}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    data: dict = {}
    sources: dict[str, str] = {}
    defaults = raw.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: 'defaults' must be a list of file paths")
    for base in defaults:
        base_path = os.path.join(os.path.dirname(path), base)
        base_data, base_sources = _read_with_defaults(base_path, chain + (real,))
        _merge(data, sources, base_data, base_sources)
    _merge(data, sources, raw, _flatten_sources(raw, path))
    return data, sources


def _flatten_sources(tree: dict, source: str, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        out[dotted] = source
        if isinstance(value, dict):
            out.update(_flatten_sources(value, source, dotted + "."))
    return out


def _merge(dst: dict, dst_sources: dict, src: dict, src_sources: dict, prefix: str = "") -> None:
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            dst_sources[dotted] = src_sources.get(dotted, dst_sources.get(dotted, ""))
            _merge(dst[key], dst_sources, value, src_sources, dotted + ".")
        else:
            dst[key] = value
            for k in [k for k in dst_sources if k == dotted or k.startswith(dotted + ".")]:
                del dst_sources[k]
            dst_sources.update({k: v for k, v in src_sources.items() if k == dotted or k.startswith(dotted + ".")})


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r} is not of the form dotted.key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def _set_dotted(data: dict, sources: dict, key: str, value: Any, source: str) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        sources.setdefault(".".join(parts[: i + 1]), source)
        node = child
    node[parts[-1]] = value
    sources[key] = source


def _build(cls: type, data: Any, prefix: str, sources: dict, default_source: str) -> Any:
    section_source = sources.get(prefix.rstrip("."), default_source)
    if not isinstance(data, dict):
        raise ConfigError(f"{section_source}: '{prefix.rstrip('.')}' must be a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            dotted = f"{prefix}{key}"
            source = sources.get(dotted, section_source)
            if dotted in REMOVED_KEYS:
                raise ConfigError(f"{source}: '{dotted}' was removed: {REMOVED_KEYS[dotted]}")
            close = difflib.get_close_matches(dotted, valid_keys(), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: unknown key '{dotted}'{hint}")
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        source = sources.get(dotted, section_source)
        tp = hints[name]
        section = section_type(tp)
        if section is not None:
            optional = section is not tp
            kwargs[name] = None if optional and value is None else _build(section, value, dotted + ".", sources,
                                                                         source)
            continue
        try:
            coerced = coerce(value, tp)
        except TypeError as err:
            raise ConfigError(f"{source}: '{dotted}' {err}") from None
        problem = range_error(coerced, fields[name].metadata)
        if problem:
            raise ConfigError(f"{source}: '{dotted}' = {problem}")
        kwargs[name] = coerced
    return cls(**kwargs)


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any) -> Any:
    """Coerce a YAML value to the annotation ``tp``; TypeError says what was expected."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        members = get_args(tp)
        if value is None and type(None) in members:
            return None
        real = [m for m in members if m is not type(None)]
        for member in real:
            try:
                return coerce(value, member)
            except NonFiniteError:
                raise  # say which number is wrong, not which types are allowed
            except TypeError:
                continue
        raise TypeError(f"must be {' or '.join(_type_name(m) for m in members)}, got {_kind(value)}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise TypeError(f"must be one of {', '.join(repr(a) for a in get_args(tp))}, got {_kind(value)}")
    if origin is list:
        (item_tp,) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"must be a list of {_type_name(item_tp)}, got {_kind(value)}")
        return [coerce(v, item_tp) for v in value]
    if origin is dict:
        key_tp, val_tp = get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise TypeError(f"must be a mapping, got {_kind(value)}")
        return {coerce(k, key_tp): coerce(v, val_tp) for k, v in value.items()}
    return _coerce_scalar(value, tp)


def _coerce_scalar(value: Any, tp: type) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # PyYAML reads 1e-5 (no dot) as a string
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise NonFiniteError(f"must be a finite number, got {number}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"has an unsupported annotation {tp!r}")
    raise TypeError(f"must be {_type_name(tp)}, got {_kind(value)}")
