"""What the transformer of every policy family shares: its sizes, the pipeline stage's input, the TE placement."""

from __future__ import annotations

from typing import Any

import torch

from leangrpo_mcore.models.common.pipeline import StageInputMixin
from leangrpo_mcore.models.common.tp import full_shape


class PolicyMixin(StageInputMixin):
    """Sizes read from the family's ``config`` and the parameter count at the unsharded size."""

    config: Any

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        """Transformer blocks in total (``config.num_layers``)."""
        return self.config.num_layers

    def num_parameters(self, *, trainable_only: bool = False) -> int:
        """Parameter count of the FULL model (tensor-parallel shards counted at their unsharded size)."""
        return sum(full_shape(p).numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def _follow_layers_to_device(self, provider) -> None:
        """Transformer Engine allocates its layers on the GPU: bring the torch-native parameters (norms, tables,
        replicated linears) along. Local layers stay where they were built."""
        if provider.name == "te":
            self.to(torch.cuda.current_device())
