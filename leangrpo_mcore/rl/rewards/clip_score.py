"""CLIPScore with OpenAI's CLIP ViT-L/14, scored as FlowGRPO's ``clip_scorer.py``:

    reward = logits_per_image.diagonal() / 30 = exp(logit_scale) · cos(image_embedding, text_embedding) / 30

(projected, L2-normalised embeddings; OpenAI's logit scale is 100, so the value is cos · 3.33: a cosine
of 0.3, usual for an image that matches its caption, gives 1.0). Weights, tokenizer and image processor:
``openai/clip-vit-large-patch14``.
"""

from typing import List, Optional

from torch import Tensor

from .clip_models import DEFAULT_BATCH_SIZE, BatchedReward, check_batch_size, load_clip_encoder
from .registry import register_reward

CLIP_SCORE_DIVISOR = 30.0
_DOWNLOAD = "openai/clip-vit-large-patch14 (CLIPModel with its processor)"


@register_reward("clip_score")
class ClipScoreReward(BatchedReward):
    """CLIP image–text similarity of each image against its prompt (module doc)."""

    def __init__(self, path: Optional[str] = None, *, processor_path: Optional[str] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        """``path``: the ``CLIPModel`` directory; ``processor_path``: tokenizer + preprocessor_config.json
        directory (default ``path``)."""
        self.batch_size = check_batch_size(batch_size)
        self.encoder = load_clip_encoder(path, processor_path, _DOWNLOAD, _DOWNLOAD, device, dtype)

    def score(self, images: Tensor, prompts: List[str]) -> Tensor:
        """CLIPScore (b,) float32 of one chunk."""
        cosine = (self.encoder.image_embeddings(images) * self.encoder.text_embeddings(prompts)).sum(-1)
        return self.encoder.logit_scale() * cosine / CLIP_SCORE_DIVISOR
