"""Megatron widths of a multi-head DiT config from diffusers' hyper-parameter names."""

from __future__ import annotations


def derive_attention_widths(config) -> int:
    """Sets a multi-head DiT config's megatron widths from diffusers' names and returns the model width:
    ``hidden_size`` is ``num_attention_heads * attention_head_dim`` (derived when 0, else checked),
    ``kv_channels`` the head width and ``ffn_hidden_size`` ``mlp_ratio * hidden_size``."""
    hidden = config.num_attention_heads * config.attention_head_dim
    if config.hidden_size == 0:
        config.hidden_size = hidden
    elif config.hidden_size != hidden:
        raise ValueError(f"hidden_size ({config.hidden_size}) must equal num_attention_heads * attention_head_dim "
                         f"({hidden})")
    config.kv_channels = config.attention_head_dim
    config.ffn_hidden_size = int(config.hidden_size * config.mlp_ratio)
    return hidden
