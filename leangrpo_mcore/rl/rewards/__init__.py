"""Reward functions: ``images (B, 3, H, W) in [0, 1] + prompts -> rewards (B,) float32``.

``build_reward(name, **options)`` returns a ``ValidatedReward``; ``available_rewards()`` lists the names.
Registered here: ``jpeg_compressibility``, ``jpeg_incompressibility`` (DDPO), ``ocr`` (FlowGRPO-style,
needs the ``ocr`` extra), the learned ``pickscore``, ``clip_score``, ``aesthetic`` and ``hpsv2`` (CLIP models,
the ``rewards`` extra), ``weighted`` (a weighted sum of the others), ``remote`` (an HTTP reward server) and the
rewards that compare a sample with its conditioning image, ``clip_consistency`` and ``first_frame_consistency``.
Every reward also scores videos (B, 3, F, H, W) on the frames that option ``frames`` picks (:mod:`.base`).
Rewards outside the package: ``package.module:callable`` or an installed entry point (:mod:`.plugins`).
"""

from . import aesthetic, clip_score, consistency, hpsv2, jpeg, ocr, pickscore, remote, weighted  # noqa: F401
from .aesthetic import AestheticReward, aesthetic_mlp
from .base import (
    RewardError,
    RewardFn,
    ValidatedReward,
    check_reward_inputs,
    check_reward_output,
    frame_indices,
    images_to_uint8,
    parse_frames,
)
from .clip_models import ImageTransform
from .clip_score import ClipScoreReward
from .consistency import ClipConsistencyReward, first_frame_consistency
from .hpsv2 import HpsV2Reward
from .jpeg import jpeg_sizes_kb
from .ocr import OcrReward, extract_quoted_text, levenshtein, ocr_text_score
from .openclip_keys import clip_config_from_openclip, openclip_to_transformers
from .pickscore import PickScoreReward
from .remote import RemoteReward
from .registry import REWARDS, available_rewards, build_reward, register_reward
from .weighted import WeightedReward

__all__ = [
    "REWARDS",
    "AestheticReward",
    "ClipConsistencyReward",
    "ClipScoreReward",
    "HpsV2Reward",
    "ImageTransform",
    "OcrReward",
    "PickScoreReward",
    "RemoteReward",
    "RewardError",
    "RewardFn",
    "ValidatedReward",
    "WeightedReward",
    "available_rewards",
    "aesthetic_mlp",
    "build_reward",
    "check_reward_inputs",
    "check_reward_output",
    "clip_config_from_openclip",
    "extract_quoted_text",
    "first_frame_consistency",
    "frame_indices",
    "images_to_uint8",
    "jpeg_sizes_kb",
    "levenshtein",
    "ocr_text_score",
    "openclip_to_transformers",
    "parse_frames",
    "register_reward",
]
