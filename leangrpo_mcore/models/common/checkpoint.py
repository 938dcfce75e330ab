"""Checkpoint files: our policy format, diffusers transformer directories, TP-resharding reads.

Our format is a directory holding

- ``leangrpo_model.json``: ``{"format": "leangrpo_mcore.policy", "version": 2, "family": ...,
  "config": <diffusers-style hyper-parameters>, "lora": null | {"rank", "alpha", "targets"}}``;
- ``model.safetensors``: the FULL (TP-gathered) tensors under our parameter names, or, in a training
  checkpoint, ``dcp/``: the sharded ``torch.distributed.checkpoint`` files holding them under ``model/<name>``
  (read with :class:`~leangrpo_mcore.models.common.dcp_source.DCPSource`).

Reads go through :class:`~leangrpo_mcore.models.common.tensor_source.TensorSource`, which opens a single
``.safetensors`` file or a sharded set (``*.safetensors.index.json`` with a ``weight_map``) lazily, and reads
only this rank's slice of a TP-partitioned parameter (so a checkpoint written at any TP size loads at any other).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.models.common.tensor_source import (  # noqa: F401 (MemorySource re-exported)
    CheckpointError,
    MemorySource,
    PrefixedSource,
    TensorSource,
    _read_json,
)
from leangrpo_mcore.models.common.tp import full_shape, gather_tensor

FORMAT_NAME = "leangrpo_mcore.policy"
FORMAT_VERSION = 2
"""2: fused q/k/v and FLUX's single-block ``proj_out`` are stored in their per-head layouts (``docs/models.md``)."""
META_FILE = "leangrpo_model.json"
WEIGHTS_FILE = "model.safetensors"
DCP_DIR = "dcp"
DIFFUSERS_CONFIG = "config.json"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
MODEL_INDEX = "model_index.json"
EXPERT_COMPONENTS = ("transformer", "transformer_2")
"""The components of a pipeline whose denoiser is two experts split at ``boundary_ratio`` (Wan2.2-A14B)."""


def is_policy_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory in our format (has ``leangrpo_model.json``)."""
    return (Path(path) / META_FILE).is_file()


def read_policy_checkpoint(path: str | os.PathLike) -> tuple[dict, TensorSource]:
    """Validated metadata and the tensors of one of our checkpoints."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory")
    meta = _read_json(folder / META_FILE)
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{folder / META_FILE} is not a {FORMAT_NAME} file (format={meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder} has format version {meta.get('version')!r}; expected {FORMAT_VERSION}")
    for key in ("family", "config"):
        if key not in meta:
            raise CheckpointError(f"{folder / META_FILE} lacks {key!r}")
    if not (folder / WEIGHTS_FILE).is_file() and (folder / DCP_DIR).is_dir():
        from leangrpo_mcore.models.common.dcp_source import DCPSource

        return meta, DCPSource(folder / DCP_DIR)
    return meta, TensorSource.from_file(folder / WEIGHTS_FILE)


def is_expert_pipeline(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a diffusers pipeline root whose denoiser is two experts: ``model_index.json`` names a
    ``transformer`` and a ``transformer_2`` and sets ``boundary_ratio`` (Wan2.2-A14B)."""
    folder = Path(path)
    if not (folder / MODEL_INDEX).is_file():
        return False
    index = _read_json(folder / MODEL_INDEX)
    return index.get("boundary_ratio") is not None and all(index.get(c) and index[c][0] is not None
                                                           for c in EXPERT_COMPONENTS)


def read_expert_pipeline(path: str | os.PathLike) -> tuple[dict, TensorSource]:
    """The experts of a two-expert pipeline root as one model: ``transformer``'s config.json with the pipeline's
    ``boundary_ratio``, and the tensors of both components under the prefixes ``transformer.`` and
    ``transformer_2.``. The experts must share one architecture (the released ones do)."""
    folder = Path(path)
    index = _read_json(folder / MODEL_INDEX)
    read = {c: read_diffusers_dir(folder / c) for c in EXPERT_COMPONENTS}
    configs = [{k: v for k, v in read[c][0].items() if not k.startswith("_")} for c in EXPERT_COMPONENTS]
    differ = sorted(k for k in set(configs[0]) | set(configs[1]) if configs[0].get(k) != configs[1].get(k))
    if differ:
        raise CheckpointError(f"{folder}: transformer and transformer_2 differ in {differ}; the two experts must "
                              f"share one architecture")
    hyper = {**read["transformer"][0], "boundary_ratio": index["boundary_ratio"]}
    return hyper, PrefixedSource({f"{c}.": read[c][1] for c in EXPERT_COMPONENTS})


def read_diffusers_dir(path: str | os.PathLike) -> tuple[dict, TensorSource]:
    """``config.json`` and the weights of a diffusers model directory (single file or sharded index), or of a
    two-expert pipeline root (:func:`read_expert_pipeline`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory")
    if is_expert_pipeline(folder):
        return read_expert_pipeline(folder)
    config = _read_json(folder / DIFFUSERS_CONFIG)
    if (folder / DIFFUSERS_INDEX).is_file():
        return config, TensorSource.from_index(folder / DIFFUSERS_INDEX)
    if (folder / DIFFUSERS_WEIGHTS).is_file():
        return config, TensorSource.from_file(folder / DIFFUSERS_WEIGHTS)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted(folder.glob("*.safetensors"))
    if len(indexes) == 1:
        return config, TensorSource.from_index(indexes[0])
    if len(files) == 1:
        return config, TensorSource.from_file(files[0])
    raise CheckpointError(f"{folder} has no unambiguous *.safetensors weights ({len(files)} files, "
                          f"{len(indexes)} indexes)")


def load_into(model: torch.nn.Module, source: TensorSource) -> None:
    """Copy every parameter's shard from ``source`` (strict: no missing, unexpected or misshapen tensors)."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(source.keys()))
    unexpected = sorted(set(source.keys()) - set(params))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not match the model: {len(missing)} missing (e.g. "
                              f"{missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            if source.shape(name) != full_shape(param):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(source.shape(name))} != model "
                                      f"shape {tuple(full_shape(param))}")
            param.copy_(source.get_shard(name, param).to(dtype=param.dtype))


def gather_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """FULL tensors of every parameter (all-gathered over TP; every TP rank must call), on the CPU."""
    return {name: gather_tensor(param, param).cpu() for name, param in model.named_parameters()}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict] = None) -> None:
    """Write ``tensors`` (detached, contiguous, CPU copies) to one safetensors file, with the mode that the
    process umask gives new files."""
    from safetensors.torch import save_file

    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(data, str(path), metadata=metadata)
    # safetensors creates its file with mode 0600; give it the mode every other file of the process gets.
    os.chmod(path, 0o666 & ~process_umask())


def process_umask() -> int:
    """The process's file-creation mask (read by setting it and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_policy_checkpoint(dst: str | os.PathLike, *, family: str, config: dict, lora: Optional[dict],
                            tensors: Optional[dict[str, torch.Tensor]]) -> Path:
    """Write our format to ``dst`` (created if needed); returns the directory. ``tensors=None`` writes the
    metadata only (a training checkpoint, whose tensors are in ``dcp/``)."""
    folder = Path(dst)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "family": family, "config": config, "lora": lora}
    if tensors is not None:
        save_safetensors(tensors, folder / WEIGHTS_FILE, metadata={"format": FORMAT_NAME})
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def write_diffusers_dir(dst: str | os.PathLike, *, class_name: str, config: dict,
                        tensors: dict[str, torch.Tensor], pipeline_class: Optional[str] = None) -> Path:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` that diffusers' from_pretrained loads; a
    config with a ``boundary_ratio`` (two experts, their tensors prefixed ``transformer.`` / ``transformer_2.``)
    is written as a pipeline root holding both components and a ``model_index.json`` of ``pipeline_class``."""
    import diffusers

    folder = Path(dst)
    folder.mkdir(parents=True, exist_ok=True)
    if config.get("boundary_ratio") is not None:
        expert_config = {k: v for k, v in config.items() if k != "boundary_ratio"}
        for component in EXPERT_COMPONENTS:
            prefix = f"{component}."
            mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            write_diffusers_dir(folder / component, class_name=class_name, config=expert_config, tensors=mine)
        index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__,
                 "boundary_ratio": config["boundary_ratio"],
                 **{component: ["diffusers", class_name] for component in EXPERT_COMPONENTS}}
        (folder / MODEL_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return folder
    full_config = {"_class_name": class_name, "_diffusers_version": diffusers.__version__, **config}
    save_safetensors(tensors, folder / DIFFUSERS_WEIGHTS, metadata={"format": "pt"})
    (folder / DIFFUSERS_CONFIG).write_text(json.dumps(full_config, indent=2, sort_keys=True) + "\n",
                                           encoding="utf-8")
    return folder


def is_writer_rank() -> bool:
    """Global rank 0 (or a single process) writes shared files."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank when torch.distributed is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
