"""Qwen-Image's text conditioning as ``QwenImagePipeline.encode_prompt`` builds it from Qwen2.5-VL.

Each prompt is put into the pipeline's chat template (a system turn asking for a detailed description, the prompt
as the user turn, an open assistant turn), tokenised (padded to the longest, at most the pipeline's 1024 tokens
plus the template's prefix) and run through ``Qwen2_5_VLForConditionalGeneration`` with its attention mask. The
last hidden states of each prompt's real tokens are kept without the first
:data:`PROMPT_TEMPLATE_START_IDX` (the system turn), cut to ``max_length`` (the pipeline's
``max_sequence_length``) and zero-padded, with a bool mask of the real ones.
"""

from __future__ import annotations

import torch

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
"""QwenImagePipeline's ``prompt_template_encode``."""
PROMPT_TEMPLATE_START_IDX = 34
"""Tokens of the template's system turn, dropped from the states (``prompt_template_encode_start_idx``)."""
TOKENIZER_MAX_LENGTH = 1024
"""The pipeline's ``tokenizer_max_length``: the prompt tokens it reads at most."""


@torch.no_grad()
def qwen_prompt_states(tokenizer, encoder: torch.nn.Module, prompts: list[str], max_length: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, max_length, D) float32, mask (B, max_length) bool) of ``prompts`` (module doc)."""
    inputs = tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts],
                       max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX, padding=True, truncation=True,
                       return_tensors="pt")
    ids, attention = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    hidden = encoder(input_ids=ids, attention_mask=attention, output_hidden_states=True).hidden_states[-1]
    tokens = hidden.new_zeros(len(prompts), max_length, hidden.shape[-1], dtype=torch.float32)
    mask = torch.zeros(len(prompts), max_length, dtype=torch.bool, device=hidden.device)
    for row in range(len(prompts)):
        # the real tokens wherever the tokenizer put its padding, the system turn dropped
        real = hidden[row][attention[row].bool()][PROMPT_TEMPLATE_START_IDX:][:max_length]
        tokens[row, :real.shape[0]] = real.float()
        mask[row, :real.shape[0]] = True
    return tokens, mask
