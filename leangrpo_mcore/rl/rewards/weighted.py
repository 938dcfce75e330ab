"""A weighted sum of named rewards: ``build_reward("weighted", weights={"ocr": 1.0, "jpeg_compressibility": 0.1})``."""

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from leangrpo_mcore.rl.advantages import weighted_sum

from .base import ValidatedReward
from .registry import build_reward, register_reward


@register_reward("weighted")
class WeightedReward:
    """Σ_k w_k · r_k over the rewards named in ``weights``, each built with ``build_reward``.

    ``normalize=True`` z-scores each component over the batch first, (r − mean) / (std + eps) with the
    population std (ddof 0), so that rewards of very different scales mix by their weights. The value
    of one sample then depends on the rest of the batch: evaluate it on the batch the advantages are
    computed on (e.g. after gathering rewards across ranks), not per rank.
    ``reward_options`` maps a reward name to its ``build_reward`` options.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        *,
        normalize: bool = False,
        eps: float = 1e-8,
        reward_options: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        """Build every component reward; ValueError for empty or non-finite weights or stray options."""
        if not weights:
            raise ValueError("weighted reward needs at least one entry in weights")
        for name, weight in weights.items():
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"weighted reward: weight of '{name}' must be a finite number, got {weight!r}")
        reward_options = dict(reward_options or {})
        stray = sorted(set(reward_options) - set(weights))
        if stray:
            raise ValueError(f"weighted reward: reward_options for rewards without a weight: {', '.join(stray)}")
        self.weights: Dict[str, float] = {name: float(w) for name, w in weights.items()}
        self.normalize = normalize
        self.eps = eps
        self.components: Dict[str, ValidatedReward] = {
            name: build_reward(name, **dict(reward_options.get(name, {}))) for name in self.weights
        }

    @property
    def needs_reference_images(self) -> bool:
        """Whether a component compares with the conditioning image."""
        return any(reward.needs_reference_images for reward in self.components.values())

    def component_values(self, images: Tensor, prompts: List[str], metadata: Optional[List[dict]] = None,
                         reference_images: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Each component's validated rewards (B,) float32, before normalisation and weighting (``metadata`` and
        ``reference_images`` reach the components that take them)."""
        return {name: reward(images, prompts, metadata, reference_images)
                for name, reward in self.components.items()}

    def combine(self, values: Mapping[str, Tensor]) -> Tensor:
        """The weighted (optionally z-scored) sum (B,) float32 of component values."""
        columns = []
        for name in self.weights:
            value = values[name].to(torch.float64)
            if self.normalize:
                value = (value - value.mean()) / (value.std(correction=0) + self.eps)
            columns.append(value)
        return weighted_sum(torch.stack(columns, dim=-1), list(self.weights.values()))

    def scored_components(self, images: Tensor, prompts: List[str], metadata: Optional[List[dict]] = None,
                          reference_images: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(components (B, K) float32 in the order of ``weights``, their :meth:`combine` (B,) float32).

        The per-component rewards that ``reward.aggregate: advantages`` turns into one group advantage each.
        """
        values = self.component_values(images, prompts, metadata, reference_images)
        return torch.stack([values[name] for name in self.weights], dim=1), self.combine(values)

    def __call__(self, images: Tensor, prompts: List[str], metadata: Optional[List[dict]] = None,
                 reference_images: Optional[Tensor] = None) -> Tensor:
        """Weighted reward (B,) float32 of images (B, 3, H, W) in [0, 1]."""
        return self.combine(self.component_values(images, prompts, metadata, reference_images))
