"""Read the tensors of a training checkpoint in tests (through the same offline reader users have)."""

import torch

from leangrpo_mcore.models.common.checkpoint import read_policy_checkpoint
from leangrpo_mcore.models.common.dcp_source import DCPSource


def model_tensors(path) -> dict[str, torch.Tensor]:
    """Every FULL policy tensor of a checkpoint directory (training checkpoint or policy directory)."""
    _, source = read_policy_checkpoint(path)
    return {key: source.get(key) for key in source.keys()}


def stored_tensors(path, prefix: str) -> dict[str, torch.Tensor]:
    """Every FULL tensor stored under ``prefix`` ('optim/', 'ema/') in a training checkpoint."""
    source = DCPSource(f"{path}/dcp", prefix=prefix)
    return {key: source.get(key) for key in source.keys()}
