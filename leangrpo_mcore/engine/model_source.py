"""The policy a run trains or evaluates, resolved once from the config's ``model`` section.

``model.path`` is opened once (its metadata and the headers of its weight files, never the weights): whether it is
one of our checkpoints or a diffusers directory, its family, hyper-parameters and stored adapters, and the lazy
readers of its tensors. Everything downstream (the layout record of checkpoints, the policy build and its sharded
load, the evaluation's checkpoint check) receives this one :class:`ModelSource` instead of re-reading the directory.
Without ``model.path`` the architecture is the family's preset with ``model.arch`` overrides. A diffusers
pipeline root (a ``model_index.json`` beside ``transformer/``) stands for its ``transformer/`` folder, as the
text-encoder and VAE keys accept it, and its ``scheduler/`` config gives the sampler's shift where
``sampler.shift`` is not set (:func:`sampler_shift`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from leangrpo_mcore.config.schema import Config, LoRAConfig as LoRASection
from leangrpo_mcore.engine.checkpoint.verify import verify_before_reading
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models import LoRAConfig, resolve_model_config
from leangrpo_mcore.models.common import checkpoint as ckpt
from leangrpo_mcore.models.common.fp8 import fp8_config
from leangrpo_mcore.models.registry import ModelFamily, PolicyFiles, read_policy_files

_PRESET_SOURCES = {"flux-dev": "FLUX.1-dev", "flux-schnell": "FLUX.1-schnell", "flux-kontext-dev": "FLUX.1-Kontext-dev",
                   "wan2.1-1.3b": "Wan2.1-T2V-1.3B",
                   "wan2.1-14b": "Wan2.1-T2V-14B", "wan2.2-ti2v-5b": "Wan2.2-TI2V-5B",
                   "wan2.2-t2v-a14b": "Wan2.2-T2V-A14B",
                   "sd3.5-medium": "stable-diffusion-3.5-medium", "sd3.5-large": "stable-diffusion-3.5-large",
                   "qwen-image": "Qwen-Image"}
"""The released model of each full-size preset, named in the error of :func:`check_random_init`."""

DEFAULT_SHIFT = 3.0
"""The static shift of the sd3, wan and dance schedules when neither ``sampler.shift`` nor a pipeline sets one."""


@dataclass(frozen=True)
class ModelSource:
    """What the policy is and where its weights come from."""

    kind: str
    """``checkpoint`` (our format), ``diffusers`` (a transformer directory) or ``preset`` (seeded random init)."""
    family: ModelFamily
    config: Any
    """The family's model config, with this run's settings applied (activation checkpointing, FP8)."""
    hyper: dict
    """Diffusers-style hyper-parameters of the architecture (what checkpoints record as ``model_config``)."""
    lora: Optional[dict]
    """The adapters the run trains (``LoRAConfig.to_dict()``): the config's, else the checkpoint's; None for a full
    fine-tune."""
    files: Optional[PolicyFiles] = None
    """Lazy readers of the weights (None for a preset)."""

    @property
    def stored_lora(self) -> Optional[LoRAConfig]:
        """The adapters stored with the weights (our format), attached when the policy is built."""
        return self.files.lora if self.files is not None else None


def check_random_init(config: Config) -> None:
    """UserError when the run would RL-train a randomly initialised full-size policy: no ``model.path`` for a
    preset other than the tiny ones, unless ``model.random_init`` says so on purpose."""
    m = config.model
    if m.path is None and m.preset is not None and "tiny" not in m.preset and not m.random_init:
        where = "pipeline root (its transformer/ and transformer_2/ are the two experts)" if "a14b" in m.preset \
            else "transformer directory"
        raise UserError(f"model.path is not set: preset {m.preset} would RL-train a randomly initialised model; set "
                        f"model.path to the {_PRESET_SOURCES.get(m.preset, 'pretrained')} {where} (or "
                        f"model.random_init: true on purpose)")


def is_pipeline_root(path: str) -> bool:
    """Whether ``path`` is a diffusers pipeline root (``model_index.json`` and a ``transformer/`` folder)."""
    return (os.path.isfile(os.path.join(path, "model_index.json"))
            and os.path.isdir(os.path.join(path, "transformer")))


def policy_dir(path: str) -> str:
    """The directory holding the policy's weights: ``path/transformer`` for a pipeline root, ``path`` itself for
    a two-expert one (its ``transformer/`` and ``transformer_2/`` are one policy) or anything else."""
    if not is_pipeline_root(path) or ckpt.is_expert_pipeline(path):
        return path
    return os.path.join(path, "transformer")


def pipeline_shift(path: Optional[str]) -> Optional[float]:
    """The shift in a pipeline root's ``scheduler/scheduler_config.json`` (``shift``, or ``flow_shift`` as Wan's
    UniPC scheduler names it); None when ``path`` is no pipeline root or its scheduler sets none. UserError
    naming the file when it is unreadable."""
    if path is None or not is_pipeline_root(path):
        return None
    file = os.path.join(path, "scheduler", "scheduler_config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as fh:
            scheduler = json.load(fh)
    except (OSError, ValueError) as err:
        raise UserError(f"model.path: cannot read {file}: {err}") from None
    for key in ("shift", "flow_shift"):
        value = scheduler.get(key) if isinstance(scheduler, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def sampler_shift(config: Config) -> float:
    """The static shift of the sampler's schedule: ``sampler.shift``, else the shift of the pipeline that
    ``model.path`` names, else :data:`DEFAULT_SHIFT`."""
    if config.sampler.shift is not None:
        return config.sampler.shift
    shift = pipeline_shift(config.model.path)
    return DEFAULT_SHIFT if shift is None else shift


def lora_section(section: LoRASection, family: ModelFamily) -> LoRAConfig:
    """The adapters of a ``model.lora`` section (the family's default targets unless listed)."""
    targets = tuple(section.targets) if section.targets is not None else tuple(family.lora_targets)
    return LoRAConfig(rank=section.rank, alpha=section.alpha, targets=targets)


def resolve_model_source(config: Config, *, check: bool = True, log: Any = None) -> ModelSource:
    """The :class:`ModelSource` of ``config``. ``check`` (a run that reads the weights; the planner, which never
    does, skips it): refuse an unintended random init of a full-size preset, and verify a training checkpoint
    named by ``model.path`` against its ``COMPLETE`` marker (collective: every rank calls this, each reads its
    share; ``checkpoint.verify: false`` skips it, logged through ``log``). One-line UserError for a bad path, a
    damaged checkpoint or a family mismatch."""
    m = config.model
    if check:
        check_random_init(config)
    if m.path is not None:
        if not os.path.isdir(m.path):
            raise UserError(f"model.path: no such directory: {m.path}")
        if check:
            verify_before_reading(m.path, "model.path", enabled=config.checkpoint.verify, log=log)
        path = policy_dir(m.path)
        files = read_policy_files(path)
        if files.family.name != m.family:
            raise UserError(f"model.path {m.path} holds a {files.family.name} policy, but model.family is {m.family}")
        family, model_config = files.family, files.config
        hyper = model_config.to_diffusers_config()
        if m.activation_checkpointing is True:  # an unresolved auto (no planner: eval, bench) stays off
            model_config = dataclasses.replace(model_config, activation_checkpointing=True)
        if m.fp8 is not None:  # FP8 is a run setting, not part of a checkpoint: apply it however the policy is built
            model_config = fp8_config(model_config, m.fp8)
        kind = "checkpoint" if ckpt.is_policy_checkpoint(path) else "diffusers"
    else:
        if m.preset is None:
            raise UserError("model: set model.path (a checkpoint) or model.preset (random init)")
        family, plain = resolve_model_config({"family": m.family, "preset": m.preset, **m.arch})
        hyper = plain.to_diffusers_config()
        _, model_config = resolve_model_config({"family": m.family, "preset": m.preset, **m.arch,
                                                "activation_checkpointing": m.activation_checkpointing is True,
                                                "fp8": m.fp8})
        files, kind = None, "preset"
    if m.experts.train != "both" and getattr(model_config, "boundary_ratio", None) is None:
        raise UserError(f"model.experts.train={m.experts.train} needs a two-expert policy (Wan2.2-A14B: a pipeline "
                        f"root with transformer/ and transformer_2/, or preset wan2.2-t2v-a14b); this one has one "
                        f"transformer: set model.experts.train=both")
    if m.lora.rank > 0:
        lora = lora_section(m.lora, family).to_dict()
    else:
        lora = files.lora.to_dict() if files is not None and files.lora is not None else None
    return ModelSource(kind=kind, family=family, config=model_config, hyper=hyper, lora=lora, files=files)

