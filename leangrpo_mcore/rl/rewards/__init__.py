"""Reward functions: ``images (B, 3, H, W) in [0, 1] + prompts -> rewards (B,) float32``.

``build_reward(name, **options)`` returns a ``ValidatedReward``; ``available_rewards()`` lists the names.
Registered here: ``jpeg_compressibility``, ``jpeg_incompressibility`` (DDPO), ``ocr`` (FlowGRPO-style,
needs the ``ocr`` extra), ``weighted`` (a weighted sum of the others) and ``remote`` (an HTTP reward server).
Rewards outside the package: ``package.module:callable`` or an installed entry point (:mod:`.plugins`).
"""

from . import jpeg, ocr, remote, weighted  # noqa: F401 -- importing registers the rewards
from .base import RewardError, RewardFn, ValidatedReward, check_reward_inputs, check_reward_output, images_to_uint8
from .jpeg import jpeg_sizes_kb
from .ocr import OcrReward, extract_quoted_text, levenshtein, ocr_text_score
from .remote import RemoteReward
from .registry import REWARDS, available_rewards, build_reward, register_reward
from .weighted import WeightedReward

__all__ = [
    "REWARDS",
    "OcrReward",
    "RemoteReward",
    "RewardError",
    "RewardFn",
    "ValidatedReward",
    "WeightedReward",
    "available_rewards",
    "build_reward",
    "check_reward_inputs",
    "check_reward_output",
    "extract_quoted_text",
    "images_to_uint8",
    "jpeg_sizes_kb",
    "levenshtein",
    "ocr_text_score",
    "register_reward",
]
