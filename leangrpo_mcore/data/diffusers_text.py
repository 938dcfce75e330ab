"""The ``diffusers`` text-conditioning provider: a pipeline's own text encoders, loaded from a local directory.

FLUX (diffusers ``FluxPipeline``): CLIP ``text_encoder`` + ``tokenizer`` give the pooled vector (pooler output,
77 tokens) and T5 ``text_encoder_2`` + ``tokenizer_2`` the token states (512 tokens, no attention mask, as the
pipeline calls it). SD3 (``StableDiffusion3Pipeline.encode_prompt``): the penultimate hidden states of CLIP-L
(``text_encoder``) and CLIP-G (``text_encoder_2``, both ``CLIPTextModelWithProjection``, 77 tokens) side by
side, zero-padded to T5's width and followed along the tokens by T5 ``text_encoder_3``'s states; the pooled
vector is both CLIPs' projected outputs side by side. Wan (``WanPipeline``): UMT5 ``text_encoder`` + ``tokenizer`` with the attention mask, and the
states after each prompt's last real token set to zero. Qwen-Image (``QwenImagePipeline.encode_prompt``):
Qwen2.5-VL ``text_encoder`` + ``tokenizer`` on the pipeline's chat template (:mod:`.qwen_image_text`). Nothing is
ever downloaded (``local_files_only``).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from leangrpo_mcore.data.qwen_image_text import qwen_prompt_states
from leangrpo_mcore.data.text_encoder import T5_MAX_LENGTH, TextDims, TextEmbeddings, TextEncoder
from leangrpo_mcore.errors import UserError, require_extra

CLIP_MAX_LENGTH = 77
_SUBFOLDERS = {
    "flux": ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"),
    "sd3": ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3", "text_encoder_3"),
    "wan": ("tokenizer", "text_encoder"),
    "qwen_image": ("tokenizer", "text_encoder"),
}


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def clean_wan_prompt(text: str) -> str:
    """Wan's prompt cleaning: ftfy (when installed), double HTML unescape, collapsed whitespace."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _config_value(path: Path, key: str) -> int:
    config = path / "config.json"
    try:
        return int(json.loads(config.read_text(encoding="utf-8"))[key])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {key!r} from {config}: {type(exc).__name__}") from None


def _qwen_width(path: Path) -> int:
    """Qwen2.5-VL's hidden size: ``text_config.hidden_size`` (transformers 5) or the top-level one (4.x)."""
    config = path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
        return int((data.get("text_config") or {}).get("hidden_size") or data["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read 'hidden_size' from {config}: {type(exc).__name__}") from None


def pipeline_text_dims(path: str | Path, family: str, *, max_length: int = T5_MAX_LENGTH) -> TextDims:
    """The dims a pipeline's encoders produce: T5/UMT5 ``d_model`` and, for FLUX, CLIP's ``hidden_size`` (SD3:
    the sum of both CLIPs' ``projection_dim``, and ``max_length`` counts CLIP's 77 tokens too; Qwen-Image:
    Qwen2.5-VL's ``hidden_size``)."""
    root = Path(path)
    if family == "qwen_image":
        return TextDims(_qwen_width(root / "text_encoder"), None, max_length)
    if family == "sd3":
        pooled = sum(_config_value(root / name, "projection_dim") for name in ("text_encoder", "text_encoder_2"))
        return TextDims(_config_value(root / "text_encoder_3", "d_model"), pooled, max_length)
    if family == "flux":
        return TextDims(
            _config_value(root / "text_encoder_2", "d_model"), _config_value(root / "text_encoder", "hidden_size"),
            max_length,
        )
    return TextDims(_config_value(root / "text_encoder", "d_model"), None, max_length)


class DiffusersTextEncoder(TextEncoder):
    """The text encoders of a diffusers FLUX, SD3, Wan or Qwen-Image pipeline directory, frozen, in eval mode."""

    def __init__(
        self,
        path: str | Path,
        family: str,
        dims: TextDims,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
        negative_prompt: Optional[str] = None,
        guidance: Optional[float] = None,
    ) -> None:
        """Load the encoders under ``path``; UserError naming what is missing or fails to load."""
        super().__init__(family, dims, negative_prompt=negative_prompt, guidance=guidance)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.root = Path(path)
        if not self.root.is_dir():
            raise UserError(f"text encoder path not found: {self.root}")
        for name in _SUBFOLDERS[family]:
            if not (self.root / name).is_dir():
                raise UserError(f"{self.root} has no '{name}' folder (expected a diffusers {family} pipeline)")
        require_extra("transformers", "text", "model.text_encoder=diffusers")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.tokenizer = self._load_tokenizer("tokenizer")
        if family == "flux":
            from transformers import CLIPTextModel, T5EncoderModel

            self.text_encoder = self._load_model(CLIPTextModel, "text_encoder", dtype)
            self.tokenizer_2 = self._load_tokenizer("tokenizer_2")
            self.text_encoder_2 = self._load_model(T5EncoderModel, "text_encoder_2", dtype)
        elif family == "sd3":
            self._load_sd3(dtype)
        elif family == "qwen_image":
            from transformers import Qwen2_5_VLForConditionalGeneration

            self.text_encoder = self._load_model(Qwen2_5_VLForConditionalGeneration, "text_encoder", dtype)
        else:
            from transformers import UMT5EncoderModel

            self.text_encoder = self._load_model(UMT5EncoderModel, "text_encoder", dtype)

    def _load_sd3(self, dtype: torch.dtype) -> None:
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        if self.dims.max_length <= CLIP_MAX_LENGTH:
            raise UserError(f"SD3's text tokens are CLIP's {CLIP_MAX_LENGTH} followed by T5's: model.text_max_length "
                            f"must exceed {CLIP_MAX_LENGTH}, got {self.dims.max_length}")
        self.text_encoder = self._load_model(CLIPTextModelWithProjection, "text_encoder", dtype)
        self.tokenizer_2 = self._load_tokenizer("tokenizer_2")
        self.text_encoder_2 = self._load_model(CLIPTextModelWithProjection, "text_encoder_2", dtype)
        self.tokenizer_3 = self._load_tokenizer("tokenizer_3")
        self.text_encoder_3 = self._load_model(T5EncoderModel, "text_encoder_3", dtype)

    def _load_tokenizer(self, name: str) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.root / name), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 -- any loader failure is reported as one line
            raise UserError(f"cannot load tokenizer {self.root / name}: {_one_line(exc)}") from None

    def _load_model(self, cls: Any, name: str, dtype: torch.dtype) -> torch.nn.Module:
        try:
            model = cls.from_pretrained(str(self.root / name), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 -- any loader failure is reported as one line
            raise UserError(f"cannot load {cls.__name__} from {self.root / name}: {_one_line(exc)}") from None
        model.requires_grad_(False)
        return model.eval().to(device=self.device, dtype=dtype)

    def _tokenize(self, tokenizer: Any, prompts: list[str], max_length: int) -> Any:
        return tokenizer(
            prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        )

    @torch.no_grad()
    def _embed_flux(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        clip_ids = self._tokenize(self.tokenizer, prompts, CLIP_MAX_LENGTH).input_ids.to(self.device)
        pooled = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        t5_ids = self._tokenize(self.tokenizer_2, prompts, self.dims.max_length).input_ids.to(self.device)
        tokens = self.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        return tokens.float(), pooled.float()

    def _clip(self, tokenizer: Any, encoder: torch.nn.Module, prompts: list[str]):
        ids = self._tokenize(tokenizer, prompts, CLIP_MAX_LENGTH).input_ids.to(self.device)
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2].float(), out[0].float()  # penultimate layer, projected pooled output

    @torch.no_grad()
    def _embed_sd3(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        clip_l, pooled_l = self._clip(self.tokenizer, self.text_encoder, prompts)
        clip_g, pooled_g = self._clip(self.tokenizer_2, self.text_encoder_2, prompts)
        t5_length = self.dims.max_length - CLIP_MAX_LENGTH
        t5_ids = self._tokenize(self.tokenizer_3, prompts, t5_length).input_ids.to(self.device)
        t5 = self.text_encoder_3(t5_ids)[0].float()
        clip = torch.cat([clip_l, clip_g], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)

    @torch.no_grad()
    def _embed_wan(self, prompts: list[str]) -> torch.Tensor:
        inputs = self._tokenize(self.tokenizer, [clean_wan_prompt(p) for p in prompts], self.dims.max_length)
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state.float()
        # WanPipeline keeps each prompt's first seq_len states and zero-pads the rest; the mask is a prefix of
        # ones, so multiplying by it is that exactly.
        return hidden * mask.unsqueeze(-1).to(hidden.dtype)

    def embed(self, prompts: list[str]) -> TextEmbeddings:
        """Tokens (B, L, D), for FLUX and SD3 pooled (B, P), for Qwen-Image the mask (B, L); float32 on the
        encoders' device."""
        tokens, pooled, masks = [], [], []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            if self.family in ("flux", "sd3"):
                embed = self._embed_flux if self.family == "flux" else self._embed_sd3
                chunk_tokens, chunk_pooled = embed(chunk)
                pooled.append(chunk_pooled)
            elif self.family == "qwen_image":
                chunk_tokens, chunk_mask = qwen_prompt_states(self.tokenizer, self.text_encoder, chunk,
                                                              self.dims.max_length, self.device)
                masks.append(chunk_mask)
            else:
                chunk_tokens = self._embed_wan(chunk)
            tokens.append(chunk_tokens)
        return TextEmbeddings(torch.cat(tokens), torch.cat(pooled) if pooled else None,
                              torch.cat(masks) if masks else None)
