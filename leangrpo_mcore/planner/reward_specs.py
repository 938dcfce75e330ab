"""Memory of the built-in learned reward models, for the layout planner (pure Python).

Only the ranks that score hold a reward model: CP rank 0 of the last pipeline stage
(``engine/step/reward_join.py``). Such a rank keeps the model resident for the whole run, in its dtype
(``reward.options.dtype``; bfloat16 on a GPU by default), and while scoring also holds the inference activations
of one batch of ``reward.options.batch_size`` images. Both are derived here from the architecture numbers of the CLIP models the rewards load (transformers
``CLIPModel``: both towers, whichever of them a score uses); non-learned rewards (JPEG, OCR on the CPU, a remote
server, plugins) add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from leangrpo_mcore.errors import UserError

DEFAULT_BATCH_SIZE = 16
"""Images per reward forward when ``reward.options.batch_size`` is not set (the rewards' default)."""
DEFAULT_DTYPE = "bfloat16"
"""The rewards' dtype on a GPU when ``reward.options.dtype`` is not set."""
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


@dataclass(frozen=True)
class Tower:
    """One transformer tower of a CLIP model (pre-LayerNorm blocks: attention + a two-layer MLP)."""

    layers: int
    width: int
    mlp_width: int
    tokens: int
    """Sequence length: image patches + the class token (vision), the context length (text)."""

    @property
    def block_params(self) -> int:
        """One block: two LayerNorms, q / k / v / out projections and the MLP's two linears, all with biases."""
        w, m = self.width, self.mlp_width
        return 2 * 2 * w + 4 * (w * w + w) + (w * m + m) + (m * w + w)

    @property
    def layer_activation_elements(self) -> int:
        """Elements alive at once in the widest part of one block of a no-grad forward of one sequence: in the MLP
        the residual stream and the LayerNorm output (2 x width) are held while fc1's output and the activation
        function's output (2 x mlp_width) both exist; the attention half holds less (residual, LayerNorm output,
        q, k, v and the attention output: 6 x width < 2 x width + 2 x mlp_width at mlp_width = 4 x width), with
        the fused attention kernels of PyTorch's SDPA keeping no tokens x tokens score matrix."""
        return self.tokens * (2 * self.width + 2 * self.mlp_width)


@dataclass(frozen=True)
class ClipSpec:
    """A CLIP model as the learned rewards load it, plus an optional MLP head on the image embedding."""

    name: str
    vision: Tower
    text: Tower
    patch_size: int
    vocab_size: int
    projection_dim: int
    head_widths: tuple[int, ...] = ()
    """Widths of a linear head on the image embedding (input first; LAION's aesthetic predictor)."""

    @property
    def params(self) -> int:
        """Parameters of both towers, their projections, the logit scale and the head."""
        v, t = self.vision, self.text
        vision = (3 * self.patch_size ** 2 * v.width  # patch embedding: a convolution without bias
                  + v.width + v.tokens * v.width  # class and position embeddings
                  + 2 * 2 * v.width  # LayerNorms before and after the blocks
                  + v.layers * v.block_params + v.width * self.projection_dim)
        text = ((self.vocab_size + t.tokens) * t.width  # token and position embeddings
                + t.layers * t.block_params + 2 * t.width + t.width * self.projection_dim)
        head = sum(a * b + b for a, b in zip(self.head_widths, self.head_widths[1:]))
        return vision + text + 1 + head

    def activation_bytes(self, batch: int, dtype_bytes: int) -> int:
        """Inference activations of one batch (no grad): the widest block of either tower (``batch`` images and
        as many prompts), freed block by block, so one block's peak is the forward's."""
        widest = max(self.vision.layer_activation_elements, self.text.layer_activation_elements)
        return batch * widest * dtype_bytes


def _clip(name: str, *, vision: tuple[int, int, int], text: tuple[int, int, int], projection_dim: int,
          head_widths: tuple[int, ...] = ()) -> ClipSpec:
    """A CLIP at 224 x 224 pixels, patch 14 (257 vision tokens), text context 77, the CLIP BPE vocabulary."""
    patch, image, context, vocab = 14, 224, 77, 49408
    return ClipSpec(name, Tower(*vision, tokens=(image // patch) ** 2 + 1), Tower(*text, tokens=context), patch,
                    vocab, projection_dim, head_widths)


# (layers, width, MLP width) of each tower, from the released configs.
VIT_H_14 = _clip("CLIP ViT-H-14", vision=(32, 1280, 5120), text=(24, 1024, 4096), projection_dim=1024)
VIT_L_14 = _clip("CLIP ViT-L/14", vision=(24, 1024, 4096), text=(12, 768, 3072), projection_dim=768)
AESTHETIC = _clip("CLIP ViT-L/14 + aesthetic MLP", vision=(24, 1024, 4096), text=(12, 768, 3072),
                  projection_dim=768, head_widths=(768, 1024, 128, 64, 16, 1))

REWARD_MODELS: dict[str, ClipSpec] = {
    "pickscore": VIT_H_14,  # PickScore_v1: a fine-tuned CLIP-ViT-H-14-laion2B
    "hpsv2": VIT_H_14,  # HPSv2.1: an open_clip ViT-H-14 state dict, loaded into the same CLIPModel
    "clip_score": VIT_L_14,  # openai/clip-vit-large-patch14
    "clip_consistency": VIT_L_14,  # the same CLIP by default (the image tower scores, the whole model is loaded)
    "aesthetic": AESTHETIC,  # LAION's improved aesthetic predictor on the CLIP ViT-L/14 image embedding
}
"""The built-in learned rewards' models, by reward name."""


@dataclass(frozen=True)
class RewardMemory:
    """Bytes of the reward model on a scoring rank."""

    weights_bytes: int = 0
    """The resident model (whole run)."""
    activation_bytes: int = 0
    """Inference activations of one scoring batch (while scoring)."""
    name: str = ""
    """The model(s), for the plan's words ('' when nothing is held)."""


def _dtype_bytes(options: Mapping[str, Any]) -> int:
    dtype = str(options.get("dtype") or DEFAULT_DTYPE).removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise UserError(f"reward.options.dtype: unknown dtype {dtype!r} (expected float32, bfloat16 or float16)")
    return _DTYPE_BYTES[dtype]


def _one(name: str, options: Mapping[str, Any]) -> RewardMemory:
    spec = REWARD_MODELS.get(name)
    if spec is None:
        return RewardMemory()
    size = _dtype_bytes(options)
    batch = int(options.get("batch_size") or DEFAULT_BATCH_SIZE)
    return RewardMemory(spec.params * size, spec.activation_bytes(batch, size), spec.name)


def reward_memory(reward: Any) -> RewardMemory:
    """What the configured reward (a ``RewardConfig``) holds on a scoring rank. ``weighted`` holds every component
    model at once and scores them one after the other (the largest batch's activations)."""
    options = dict(reward.options or {})
    if reward.name != "weighted":
        return _one(reward.name, options)
    per_reward = dict(options.get("reward_options") or {})
    parts = [_one(name, dict(per_reward.get(name) or {})) for name in (reward.weights or {})]
    names = " + ".join(p.name for p in parts if p.name)
    return RewardMemory(sum(p.weights_bytes for p in parts), max((p.activation_bytes for p in parts), default=0),
                        names)
