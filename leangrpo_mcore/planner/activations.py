"""Activation memory of one grad-enabled policy forward, from measured per-token, per-layer constants.

The bytes autograd saves in a forward are linear in features of the architecture, the token counts and the
tensor-parallel degree (flash / memory-efficient attention saves no T x T matrix): for every block kind, tokens x
hidden width that every TP rank holds whole (the block input, its norms and modulated copies, the branch outputs
the gates multiply), tokens x hidden width split over TP (q/k/v, the attention output and, for FLUX, the MLP
hidden state), tokens x MLP width split over TP (Wan), tokens x heads split over TP (the fp32 log-sum-exp of
attention), width alone (per-sample modulation vectors), for Wan's cross-attention text tokens x width split over
TP, and with LoRA tokens x rank (the adapters' inner activations); outside the blocks, tokens x width, tokens x
head width (the rotary tables), width and the raw inputs. The coefficients (bytes per unit of each feature) are
fitted by least squares to the saved-tensor bytes of real forwards of the policy on small configs at TP 1 and 2,
per compute dtype, with and without per-block activation checkpointing, for full fine-tuning and for LoRA on the
default targets (frozen linears save no input)::

    python tools/calibrate_activations.py --write

which measures with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded) and
regenerates :mod:`leangrpo_mcore.planner.activation_fit` with the fitted constants and their residuals.
This module only evaluates the fit (pure Python).
"""

from __future__ import annotations

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.activation_fit import FIT
from leangrpo_mcore.planner.arch_specs import ArchSpec

DTYPE_NAMES = {4: "fp32", 2: "bf16"}


def activation_features(arch: ArchSpec, tokens: dict[str, int], checkpointing: bool, *, tp: int = 1,
                        lora_rank: int = 0) -> dict[str, float]:
    """The features the saved bytes of one sample's forward on one TP rank are linear in (names match the fitted
    constants). ``lora_rank`` > 0: LoRA adapters of that rank on the default targets, the base frozen."""
    if tp < 1 or lora_rank < 0:
        raise UserError(f"tp must be >= 1 and lora_rank >= 0, got tp={tp}, lora_rank={lora_rank}")
    d, h, hd = arch.hidden_size, arch.num_heads, arch.head_dim
    feats: dict[str, float] = {}
    for block in arch.blocks:
        t = tokens[block.stream]
        key = f"{block.kind}.ckpt" if checkpointing else block.kind
        feats[f"{key}.T.D"] = block.count * t * d  # replicated over TP
        feats[f"{key}.D"] = block.count * d  # per-sample vectors: modulation chunks, gates, time embedding
        if not checkpointing:
            feats[f"{key}.T.Ds"] = block.count * t * d / tp  # head-parallel (FLUX: MLP width 4x, folded in)
            if arch.family == "wan":
                feats[f"{key}.T.F"] = block.count * t * block.mlp_dim / tp
            feats[f"{key}.T.H"] = block.count * t * h / tp
            if lora_rank:
                feats[f"{key}.T.r"] = block.count * t * lora_rank
        if arch.family == "wan":
            feats[f"{key}.Ttxt.D"] = block.count * tokens["text"] * d / tp
    rope_stream = "joint" if arch.family in ("flux", "qwen_image") else "image"
    feats["root.Timg.D"] = tokens["image"] * d
    feats["root.Ttxt.D"] = tokens["text"] * d
    feats["root.D"] = d
    feats["root.T.hd"] = tokens[rope_stream] * hd
    feats["root.in"] = tokens["image"] * _input_width(arch) + tokens["text"] * _text_width(arch)
    # A later pipeline stage keeps the root terms too (its received boundary and rotary tables stand in for the
    # embedders' outputs): an upper bound by the embedders' few per-token vectors.
    return feats


def _input_width(arch: ArchSpec) -> int:
    """Width of the raw latent input (0 on a pipeline stage without the embedders: it saves no raw input)."""
    names = ("x_embedder", "patch_embedding", "pos_embed.proj", "img_in")
    return next((lin.in_features for lin in arch.root if lin.name in names), 0)


def _text_width(arch: ArchSpec) -> int:
    names = ("context_embedder", "condition_embedder.text_embedder.linear_1", "txt_in")
    return next((lin.in_features for lin in arch.root if lin.name in names), 0)


def fit_key(family: str, dtype_bytes: int, checkpointing: bool, lora: bool = False) -> str:
    """The key of one fitted coefficient set."""
    if dtype_bytes not in DTYPE_NAMES:
        raise UserError(f"no activation fit for a {dtype_bytes}-byte compute dtype (fp32 or bf16 only)")
    return f"{family}/{DTYPE_NAMES[dtype_bytes]}/{'ckpt' if checkpointing else 'plain'}" + ("/lora" if lora else "")


def _coefficients(fit: dict | None, key: str, feats: dict[str, float]) -> dict[str, float]:
    entry = (fit or FIT).get(key)
    if entry is None:
        raise UserError(f"no activation fit {key} (regenerate with tools/calibrate_activations.py --write)")
    missing = sorted(set(feats) - set(entry["coef"]))
    if missing:
        raise UserError(f"the activation fit {key} lacks {missing}")
    return entry["coef"]


def saved_bytes(arch: ArchSpec, tokens: dict[str, int], *, batch: int, dtype_bytes: int,
                checkpointing: bool, tp: int = 1, lora_rank: int = 0, fit: dict | None = None) -> int:
    """Bytes autograd keeps on one TP rank for the backward of one forward of ``batch`` samples (``lora_rank`` > 0:
    LoRA on the default targets with the base frozen; other targets are charged as full fine-tuning)."""
    if batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}")
    feats = activation_features(arch, tokens, checkpointing, tp=tp, lora_rank=lora_rank)
    coef = _coefficients(fit, fit_key(arch.family, dtype_bytes, checkpointing, lora_rank > 0), feats)
    return int(batch * max(0.0, sum(coef[name] * value for name, value in feats.items())))


def block_saved_bytes(arch: ArchSpec, tokens: dict[str, int], *, batch: int, dtype_bytes: int, tp: int = 1,
                      lora_rank: int = 0, fit: dict | None = None) -> int:
    """Saved bytes of the largest single block without checkpointing (what a checkpointed backward recomputes)."""
    feats = activation_features(arch, tokens, False, tp=tp, lora_rank=lora_rank)
    coef = _coefficients(fit, fit_key(arch.family, dtype_bytes, False, lora_rank > 0), feats)
    best = 0.0
    for block in arch.blocks:
        per = sum(coef.get(name, 0.0) * value for name, value in feats.items() if name.startswith(block.kind + "."))
        best = max(best, per / block.count if block.count else 0.0)
    return int(batch * best)


def working_bytes(arch: ArchSpec, tokens: dict[str, int], *, batch: int, dtype_bytes: int) -> int:
    """Peak transient bytes of a no-grad block forward: residual, its normed copy, q/k/v + output, MLP hidden x2.

    An upper-bound estimate from the block structure (no-grad tensors die as soon as the next op has run), used
    for the rollout's working set and for the gradients of activations alive during a backward.
    """
    widest = 0
    for block in arch.blocks:
        t = tokens[block.stream]
        widest = max(widest, t * max(6 * arch.hidden_size, 2 * arch.hidden_size + 2 * block.mlp_dim))
    return batch * widest * dtype_bytes
