"""OCR text-rendering reward in FlowGRPO's form (``flow_grpo/ocr.py``), read with rapidocr 3.x on onnxruntime.

Per image: the target is the text quoted in the prompt; the recognised text is the concatenation of
every detected line (top to bottom) with confidence > ``min_score``. Both are lower-cased and have their
spaces removed. Then

    d = 0                                  if target is a substring of recognised
    d = min(levenshtein(recognised, target), len(target))   otherwise
    reward = 1 − d / len(target)           in [0, 1]

Differences from FlowGRPO, on purpose: FlowGRPO takes ``prompt.split('"')[1]`` and crashes on a prompt
without a double quote; here the first "..." span is used, else the first '...' span whose quotes are
not apostrophes inside words, and a prompt with neither is a ValueError (``missing_target="error"``,
the default: an OCR data set without targets is a bug) or reward 0 (``missing_target="zero"``).
FlowGRPO turns an OCR engine exception into reward 0 with a print; here it becomes a RewardError.
PaddleOCR (FlowGRPO) and rapidocr run the same PP-OCR model family, so scores are close, not equal. The
detection and recognition models ship inside the rapidocr wheel (PP-OCRv6 small in 3.10): nothing is downloaded.
"""

import re
from typing import Any, List, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from leangrpo_mcore.errors import require_extra

from .base import images_to_uint8
from .registry import register_reward

# rapidocr defaults differ from the PaddleOCR 2.x defaults FlowGRPO ran with: it drops lines with a
# confidence under 0.5 (FlowGRPO keeps every line with confidence > 0) and upsamples the shorter side
# to 736 px before detection (PaddleOCR only downsamples the longer side to 960 px, which is also
# ~10x cheaper on small images). These options (rapidocr's dotted config keys) restore PaddleOCR's
# behaviour; the log level keeps rapidocr from warning about every image without text.
PADDLE_LIKE_ENGINE_OPTIONS = {"Global.text_score": 0.0, "Det.limit_type": "max", "Det.limit_side_len": 960,
                              "Global.log_level": "error"}

_DOUBLE_QUOTED = re.compile(r'"([^"]*)"')
# A single-quoted span must open after a non-word character and close before one, so that the
# apostrophes of "dog's" or "don't" are not taken for quotes.
_SINGLE_QUOTED = re.compile(r"(?<!\w)'([^']*)'(?!\w)")


def extract_quoted_text(prompt: str) -> Optional[str]:
    """The first "..." span of ``prompt``, else the first '...' span, else None."""
    for pattern in (_DOUBLE_QUOTED, _SINGLE_QUOTED):
        match = pattern.search(prompt)
        if match is not None:
            return match.group(1)
    return None


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            substitute = previous[j - 1] + (char_a != char_b)
            current.append(min(previous[j] + 1, current[j - 1] + 1, substitute))
        previous = current
    return previous[-1]


def _normalise(text: str) -> str:
    # FlowGRPO removes plain spaces only (not all whitespace) and lower-cases.
    return text.replace(" ", "").lower()


def ocr_text_score(recognised: str, target: str) -> float:
    """FlowGRPO's OCR score in [0, 1] of ``recognised`` text against ``target`` (see module doc)."""
    recognised, target = _normalise(recognised), _normalise(target)
    if not target:
        raise ValueError("the OCR target text is empty after removing spaces")
    if target in recognised:
        return 1.0
    # Capping at len(target): many unrelated recognised characters cost no more than reading nothing.
    distance = min(levenshtein(recognised, target), len(target))
    return 1.0 - distance / len(target)


def _load_engine(engine_options: Mapping[str, Any]) -> Any:
    rapidocr = require_extra("rapidocr", "ocr", "reward.name=ocr")
    require_extra("onnxruntime", "ocr", "reward.name=ocr")
    return rapidocr.RapidOCR(params={**PADDLE_LIKE_ENGINE_OPTIONS, **engine_options})


@register_reward("ocr")
class OcrReward:
    """FlowGRPO's OCR reward (module doc) with a rapidocr engine (onnxruntime) on the CPU."""

    def __init__(
        self,
        *,
        missing_target: str = "error",
        min_score: float = 0.0,
        engine_options: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """``missing_target``: "error" or "zero" for prompts without quoted text; ``min_score``: keep
        detections with confidence strictly above it (FlowGRPO: 0); ``engine_options``: RapidOCR ``params``
        (dotted config keys such as ``"Det.limit_side_len"``) overriding ``PADDLE_LIKE_ENGINE_OPTIONS``."""
        if missing_target not in ("error", "zero"):
            raise ValueError(f"missing_target must be 'error' or 'zero', got {missing_target!r}")
        self.missing_target = missing_target
        self.min_score = float(min_score)
        self.engine = _load_engine(engine_options or {})

    def recognise(self, pixels: np.ndarray) -> str:
        """Text read from one (H, W, 3) uint8 RGB image: its lines concatenated, top to bottom."""
        # rapidocr treats numpy input as BGR (OpenCV order).
        result = self.engine(np.ascontiguousarray(pixels[..., ::-1]), use_det=True, use_cls=False, use_rec=True)
        if not result.txts:
            return ""
        return "".join(text for text, score in zip(result.txts, result.scores, strict=True)
                       if float(score) > self.min_score)

    def __call__(self, images: Tensor, prompts: List[str]) -> Tensor:
        """OCR rewards (B,) float32 of images (B, 3, H, W) in [0, 1] against their prompts' quoted text."""
        rewards = []
        for pixels, prompt in zip(images_to_uint8(images), prompts, strict=True):
            target = extract_quoted_text(prompt)
            if target is None:
                if self.missing_target == "error":
                    raise ValueError(f"prompt has no quoted text to render: {prompt[:80]!r}")
                rewards.append(0.0)
                continue
            rewards.append(ocr_text_score(self.recognise(pixels), target))
        return torch.tensor(rewards, dtype=torch.float32)
