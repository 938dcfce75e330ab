"""open_clip CLIP state dicts in a transformers ``CLIPModel``: the config from the tensor shapes, the key mapping.

open_clip (``open_clip/transformer.py``) and transformers (``models/clip/modeling_clip.py``) compute the same
pre-LN transformer; the names differ, attention keeps q, k, v in one ``in_proj`` matrix (rows q, then k, then
v), and the two projections are ``x @ proj`` matrices rather than linear weights (so they are transposed).
Head counts cannot be read from shapes: the defaults are ViT-H-14's (16 and 16; open_clip's vision head width is
80 there). Both towers use exact GELU and LayerNorm eps 1e-5, unlike OpenAI's quick-GELU checkpoints.
"""

import re
from typing import Any, Dict, Mapping, Optional

from torch import Tensor

from leangrpo_mcore.errors import UserError, require_extra

VIT_H_14_HEADS = 16
# Buffers that open_clip versions saved but that are rebuilt, not learned.
_IGNORED = {"attn_mask", "visual.attn_mask"}
_TOP_LEVEL = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_RESBLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)$")


def strip_module_prefix(state_dict: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """``state_dict`` without the leading ``module.`` that a DistributedDataParallel save adds."""
    return {key.removeprefix("module."): value for key, value in state_dict.items()}


def _num_blocks(state_dict: Mapping[str, Tensor], prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}transformer\.resblocks\.(\d+)\.")
    indices = {int(m.group(1)) for key in state_dict if (m := pattern.match(key))}
    return max(indices) + 1 if indices else 0


def _shape(state_dict: Mapping[str, Tensor], key: str) -> tuple:
    if key not in state_dict:
        raise UserError(f"reward.options.path: not an open_clip CLIP state dict (no {key})")
    return tuple(state_dict[key].shape)


def clip_config_from_openclip(state_dict: Mapping[str, Tensor], *, eos_token_id: Optional[int] = None,
                              bos_token_id: Optional[int] = None, vision_heads: int = VIT_H_14_HEADS,
                              text_heads: int = VIT_H_14_HEADS) -> Any:
    """The transformers ``CLIPConfig`` of an open_clip CLIP ``state_dict`` (widths, depths, patch and image
    size, context length, vocabulary and projection size read from its shapes; exact GELU, eps 1e-5).

    The text tower pools the first ``eos_token_id`` token, the end-of-text token at which open_clip pools
    (the argmax id of a CLIP BPE sequence). Its default is the last id of the vocabulary and the start token
    the one before, as in the CLIP BPE vocabulary (49407 and 49406)."""
    transformers = require_extra("transformers", "rewards", "reward.name=hpsv2")
    vision_width, _, patch, _ = _shape(state_dict, "visual.conv1.weight")
    positions = _shape(state_dict, "visual.positional_embedding")[0]
    grid = round((positions - 1) ** 0.5)
    if grid * grid != positions - 1:
        raise UserError(f"reward.options.path: {positions - 1} patch positions are not a square grid")
    vocab, text_width = _shape(state_dict, "token_embedding.weight")
    projection = _shape(state_dict, "visual.proj")[1]
    if _shape(state_dict, "text_projection")[1] != projection:
        raise UserError("reward.options.path: the image and text projections have different sizes")
    eos_token_id = vocab - 1 if eos_token_id is None else eos_token_id
    bos_token_id = vocab - 2 if bos_token_id is None else bos_token_id
    common = dict(hidden_act="gelu", layer_norm_eps=1e-5)
    vision = dict(hidden_size=vision_width, num_hidden_layers=_num_blocks(state_dict, "visual."),
                  intermediate_size=_shape(state_dict, "visual.transformer.resblocks.0.mlp.c_fc.weight")[0],
                  num_attention_heads=vision_heads, patch_size=patch, image_size=patch * grid, **common)
    text = dict(hidden_size=text_width, num_hidden_layers=_num_blocks(state_dict, ""), vocab_size=vocab,
                intermediate_size=_shape(state_dict, "transformer.resblocks.0.mlp.c_fc.weight")[0],
                num_attention_heads=text_heads, max_position_embeddings=_shape(state_dict, "positional_embedding")[0],
                eos_token_id=eos_token_id, bos_token_id=bos_token_id, pad_token_id=0, **common)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection)


def _block_keys(tower: str, index: str, name: str, kind: str, value: Tensor) -> Dict[str, Tensor]:
    prefix = f"{tower}.encoder.layers.{index}."
    if name == "attn.in_proj":
        query, key, value_part = value.chunk(3, dim=0)
        return {f"{prefix}self_attn.q_proj.{kind}": query, f"{prefix}self_attn.k_proj.{kind}": key,
                f"{prefix}self_attn.v_proj.{kind}": value_part}
    if name not in _BLOCK:
        raise UserError(f"reward.options.path: unknown open_clip block parameter {name}.{kind}")
    return {f"{prefix}{_BLOCK[name]}.{kind}": value}


def openclip_to_transformers(state_dict: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The ``CLIPModel`` state dict of an open_clip CLIP ``state_dict`` (keys renamed, in_proj split into q, k, v,
    projections transposed); UserError naming a key it does not know."""
    mapped: Dict[str, Tensor] = {}
    for key, value in strip_module_prefix(state_dict).items():
        # nn.MultiheadAttention names its packed projection in_proj_weight / in_proj_bias.
        block = _RESBLOCK.match(re.sub(r"attn\.in_proj_(weight|bias)$", r"attn.in_proj.\1", key))
        if key in _IGNORED:
            continue
        if key in _TOP_LEVEL:
            mapped[_TOP_LEVEL[key]] = value
        elif key in _TRANSPOSED:
            mapped[_TRANSPOSED[key]] = value.t().contiguous()
        elif block is not None:
            tower = "vision_model" if block.group(1) else "text_model"
            mapped.update(_block_keys(tower, block.group(2), block.group(3), block.group(4), value))
        else:
            raise UserError(f"reward.options.path: unknown open_clip parameter {key}")
    return mapped
