"""The LAION improved aesthetic predictor ("sac+logos+ava1-l14-linearMSE"), as FlowGRPO's ``aesthetic_scorer.py``.

An MLP on the projected, L2-normalised CLIP ViT-L/14 image embedding::

    Linear(768, 1024) · Dropout(0.2) · Linear(1024, 128) · Dropout(0.2) · Linear(128, 64) · Dropout(0.1)
    · Linear(64, 16) · Linear(16, 1)

with no activations (the released head is linear; dropout is inactive in eval). The value is the predicted
aesthetic rating on the AVA 1–10 scale (most generated images score 4–7). The prompt is not used. Files:
the ``openai/clip-vit-large-patch14`` CLIPModel directory and ``sac+logos+ava1-l14-linearMSE.pth`` from the
improved-aesthetic-predictor repository (``christophschuhmann/improved-aesthetic-predictor``).
"""

import os
from typing import List, Mapping, Optional

import torch
from torch import Tensor, nn

from leangrpo_mcore.errors import UserError

from .clip_models import (DEFAULT_BATCH_SIZE, BatchedReward, check_batch_size, load_clip_encoder, local_or_hub,
                          read_state_dict_file)
from .registry import register_reward

_LINEAR_INDICES = (0, 2, 4, 6, 7)
_DROPOUTS = (0.2, 0.2, 0.1)  # the released model's; inactive in eval
_MLP_DOWNLOAD = "sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor)"
_CLIP_DOWNLOAD = "openai/clip-vit-large-patch14 (CLIPModel with its processor)"


def aesthetic_mlp(state_dict: Mapping[str, Tensor], source: str = "the state dict") -> nn.Sequential:
    """The predictor's ``layers`` Sequential (linears at 0, 2, 4, 6, 7; dropouts at 1, 3, 5) with sizes read from
    ``state_dict`` (keys ``layers.N.weight`` / ``layers.N.bias``), weights loaded strictly; errors name
    ``source`` (the file)."""
    state_dict = {key.removeprefix("layers."): value for key, value in state_dict.items()}
    try:
        shapes = [tuple(state_dict[f"{index}.weight"].shape) for index in _LINEAR_INDICES]
        if any(len(shape) != 2 for shape in shapes):
            raise UserError(f"reward.options.mlp_path: {source}: the linear weights are not matrices ({shapes})")
    except KeyError as exc:
        raise UserError(f"reward.options.mlp_path: {source} is not an aesthetic predictor state dict "
                        f"(no layers.{exc.args[0]})") from None
    modules: List[nn.Module] = []
    for position, (out_features, in_features) in enumerate(shapes):
        modules.append(nn.Linear(in_features, out_features))
        if position < len(_DROPOUTS):
            modules.append(nn.Dropout(_DROPOUTS[position]))
    mlp = nn.Sequential(*modules)
    try:
        mlp.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:
        raise UserError(f"reward.options.mlp_path: {source}: {' '.join(str(exc).split())[:300]}") from None
    return mlp


@register_reward("aesthetic")
class AestheticReward(BatchedReward):
    """LAION aesthetic score of each image (module doc)."""

    def __init__(self, path: Optional[str] = None, *, mlp_path: Optional[str] = None,
                 processor_path: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        """``path``: the CLIP ViT-L/14 ``CLIPModel`` directory; ``mlp_path``: the predictor's .pth state dict;
        ``processor_path``: the image processor directory (default ``path``)."""
        self.batch_size = check_batch_size(batch_size)
        mlp_file = local_or_hub("mlp_path", mlp_path, _MLP_DOWNLOAD, hub=False)
        if not os.path.isfile(mlp_file):
            raise UserError(f"reward.options.mlp_path: {mlp_file} is not a file; download {_MLP_DOWNLOAD}")
        # The small head first: a wrong file is reported before the CLIP model is read.
        mlp = aesthetic_mlp(read_state_dict_file("mlp_path", mlp_file, _MLP_DOWNLOAD), mlp_file)
        self.encoder = load_clip_encoder(path, processor_path, _CLIP_DOWNLOAD, _CLIP_DOWNLOAD, device, dtype,
                                         tokenizer=False)
        projection = int(self.encoder.model.config.projection_dim)
        if mlp[0].in_features != projection:
            raise UserError(f"reward.options.mlp_path: {mlp_file} takes {mlp[0].in_features}-wide embeddings, the "
                            f"CLIP model in reward.options.path projects to {projection}")
        self.mlp = mlp.to(self.encoder.device, self.encoder.dtype).eval().requires_grad_(False)

    def score(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Aesthetic ratings (b,) float32 of one chunk (the prompts are ignored)."""
        embeddings = self.encoder.image_embeddings(images).to(self.encoder.dtype)
        return self.mlp(embeddings).squeeze(-1).to(torch.float32)
