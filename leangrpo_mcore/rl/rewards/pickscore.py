"""PickScore (Kirstain et al. 2023): a CLIP-ViT-H-14 fine-tuned on human preferences, scored as FlowGRPO does.

    reward = exp(logit_scale) · cos(text_embedding, image_embedding) / 26

with the projected, L2-normalised embeddings of ``CLIPModel`` (FlowGRPO's ``pickscore_scorer.py``; the division
by 26 brings the usual values near 0.8–0.9). Weights: ``yuvalkirstain/PickScore_v1``; tokenizer and image
processor: those of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.
"""

from typing import List, Optional

from torch import Tensor

from .clip_models import DEFAULT_BATCH_SIZE, BatchedReward, check_batch_size, load_clip_encoder
from .registry import register_reward

PICKSCORE_DIVISOR = 26.0


@register_reward("pickscore")
class PickScoreReward(BatchedReward):
    """PickScore of each image against its prompt (module doc)."""

    def __init__(self, path: Optional[str] = None, *, processor_path: Optional[str] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        """``path``: the PickScore_v1 ``CLIPModel`` directory; ``processor_path``: the directory with the
        tokenizer and ``preprocessor_config.json`` (default ``path``)."""
        self.batch_size = check_batch_size(batch_size)
        self.encoder = load_clip_encoder(path, processor_path, "yuvalkirstain/PickScore_v1 (CLIPModel)",
                                         "the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device, dtype)

    def score(self, images: Tensor, prompts: List[str]) -> Tensor:
        """PickScore (b,) float32 of one chunk."""
        cosine = (self.encoder.text_embeddings(prompts) * self.encoder.image_embeddings(images)).sum(-1)
        return self.encoder.logit_scale() * cosine / PICKSCORE_DIVISOR
