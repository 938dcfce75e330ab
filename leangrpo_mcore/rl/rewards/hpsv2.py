"""HPSv2.1 (Human Preference Score v2.1, Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences.

The released ``HPS_v2.1_compressed.pt`` (hub repository ``xswu/HPSv2``) is an open_clip state dict; it is loaded
into a transformers ``CLIPModel`` through :mod:`.openclip_keys` (open-clip-torch is not needed). As HPSv2's own
scorer, the value is the cosine of the normalised image and text embeddings, ``image_features @
text_features.T`` on the diagonal, with no logit scale: usually 0.2–0.35 for generated images.

Text: open_clip's tokenizer is the CLIP BPE (lower-cased, whitespace-collapsed) with context 77: ``<start>``
tokens ``<end>``, truncated to 77 with the end token kept, then padded with id 0. Any CLIP BPE tokenizer
directory gives the same ids (option ``processor_path``, e.g. ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
open_clip pools the text at the argmax id, the end token; the config pools the first end token, the same one.
Images: open_clip's eval transform for ViT-H-14: bicubic resize of the shortest edge to 224, centre crop
(offsets rounded, as torchvision's), OpenAI's mean and std.
"""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from leangrpo_mcore.errors import UserError, require_extra

from .clip_models import (
    DEFAULT_BATCH_SIZE,
    BatchedReward,
    ClipEncoder,
    ImageTransform,
    check_batch_size,
    load_tokenizer,
    read_state_dict_file,
    local_or_hub,
    resolve_device,
    resolve_dtype,
)
from .openclip_keys import clip_config_from_openclip, openclip_to_transformers, strip_module_prefix
from .registry import register_reward

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DOWNLOAD = "HPS_v2.1_compressed.pt from xswu/HPSv2"
_TOKENIZER_DOWNLOAD = "a CLIP BPE tokenizer (e.g. laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"


def load_openclip_state_dict(path: str) -> Dict[str, Tensor]:
    """The open_clip state dict in file ``path`` (unwrapped from ``{"state_dict": ...}``, ``module.`` stripped)."""
    loaded = read_state_dict_file("path", path, _DOWNLOAD)
    return strip_module_prefix(loaded)


def clip_from_openclip(state_dict: Mapping[str, Tensor], config: Any, device: torch.device,
                       dtype: torch.dtype) -> Any:
    """A frozen eval ``CLIPModel`` of ``config`` holding the open_clip ``state_dict``, on ``device`` in ``dtype``."""
    transformers = require_extra("transformers", "rewards", "reward.name=hpsv2")
    # Built on the meta device: the weights come from the file, so random initialisation would be wasted time.
    with torch.device("meta"):
        model = transformers.CLIPModel(config)
    missing, unexpected = model.load_state_dict(openclip_to_transformers(state_dict), strict=False, assign=True)
    missing = [key for key in missing if not key.endswith("position_ids")]
    if missing or unexpected:
        raise UserError(f"reward.options.path: the open_clip state dict does not fill the CLIPModel "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for module in model.modules():
        positions = module._buffers.get("position_ids")
        if positions is not None and positions.is_meta:
            module.position_ids = torch.arange(positions.shape[-1]).expand(positions.shape)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


class OpenClipTextEncoder(ClipEncoder):
    """A ``ClipEncoder`` whose text input is open_clip's: the full context, zeros after the end token, no mask."""

    def text_inputs(self, prompts: Sequence[str]) -> dict:
        """Token ids (B, context) padded with 0, truncated to the context length with the end token kept."""
        ids = self.tokenizer(list(prompts), truncation=True, max_length=self.max_length)["input_ids"]
        tokens = torch.zeros(len(ids), self.max_length, dtype=torch.long)
        for row, sequence in enumerate(ids):
            tokens[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        return {"input_ids": tokens.to(self.device)}


@register_reward("hpsv2")
class HpsV2Reward(BatchedReward):
    """HPSv2.1 score of each image against its prompt (module doc)."""

    def __init__(self, path: Optional[str] = None, *, processor_path: Optional[str] = None,
                 device: Optional[str] = None, dtype: Optional[str] = None,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        """``path``: ``HPS_v2.1_compressed.pt``; ``processor_path``: a CLIP BPE tokenizer directory."""
        self.batch_size = check_batch_size(batch_size)
        checkpoint = local_or_hub("path", path, _DOWNLOAD, hub=False)
        if not os.path.isfile(checkpoint):
            raise UserError(f"reward.options.path: {checkpoint} is not a file; download {_DOWNLOAD}")
        tokenizer = load_tokenizer("processor_path", local_or_hub("processor_path", processor_path,
                                                                  _TOKENIZER_DOWNLOAD), _TOKENIZER_DOWNLOAD)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        state_dict = load_openclip_state_dict(checkpoint)
        config = clip_config_from_openclip(state_dict, eos_token_id=tokenizer.eos_token_id,
                                           bos_token_id=tokenizer.bos_token_id)
        model = clip_from_openclip(state_dict, config, torch_device, torch_dtype)
        size = config.vision_config.image_size
        transform = ImageTransform(shortest_edge=size, crop_size=(size, size), mean=OPENAI_CLIP_MEAN,
                                   std=OPENAI_CLIP_STD, round_crop_offset=True)
        self.encoder = OpenClipTextEncoder(model, transform, tokenizer, torch_device, torch_dtype)

    def score(self, images: Tensor, prompts: List[str]) -> Tensor:
        """HPSv2.1 scores (b,) float32 of one chunk."""
        return (self.encoder.image_embeddings(images) * self.encoder.text_embeddings(prompts)).sum(-1)
