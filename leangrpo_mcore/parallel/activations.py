"""Activation memory of one grad-enabled policy forward, from measured per-token, per-layer constants.

The bytes autograd saves in a forward are linear in features of the architecture and the token counts (flash /
memory-efficient attention saves no T x T matrix): for every block kind, tokens x hidden width, tokens x MLP
width, tokens x heads (the fp32 log-sum-exp of attention), width alone (per-sample modulation vectors) and, for Wan's
cross-attention, text tokens x width; outside the blocks, tokens x width, tokens x head width (the rotary
tables), width and the raw inputs. The coefficients
(bytes per unit of each feature) are fitted by least squares to the saved-tensor bytes of real forwards of the
policy on small configs, per compute dtype, with and without per-block activation checkpointing::

    python tools/calibrate_activations.py --write

which measures with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded) and
regenerates :mod:`leangrpo_mcore.parallel.activation_fit` with the fitted constants and their residuals.
This module only evaluates the fit (pure Python).
"""

from __future__ import annotations

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.activation_fit import FIT
from leangrpo_mcore.parallel.arch_specs import ArchSpec

DTYPE_NAMES = {4: "fp32", 2: "bf16"}


def activation_features(arch: ArchSpec, tokens: dict[str, int], checkpointing: bool) -> dict[str, float]:
    """The features the saved bytes of one sample's forward are linear in (names match the fitted constants)."""
    d, h, hd = arch.hidden_size, arch.num_heads, arch.head_dim
    feats: dict[str, float] = {}
    for block in arch.blocks:
        t = tokens[block.stream]
        key = f"{block.kind}.ckpt" if checkpointing else block.kind
        feats[f"{key}.T.D"] = block.count * t * d
        feats[f"{key}.D"] = block.count * d  # per-sample vectors: modulation chunks, gates, time embedding
        if not checkpointing:
            if arch.family == "wan":  # FLUX's MLP width is always 4x the hidden width: folded into T.D
                feats[f"{key}.T.F"] = block.count * t * block.mlp_dim
            feats[f"{key}.T.H"] = block.count * t * h
        if arch.family == "wan":
            feats[f"{key}.Ttxt.D"] = block.count * tokens["text"] * d
    rope_stream = "joint" if arch.family == "flux" else "image"
    feats["root.Timg.D"] = tokens["image"] * d
    feats["root.Ttxt.D"] = tokens["text"] * d
    feats["root.D"] = d
    feats["root.T.hd"] = tokens[rope_stream] * hd
    feats["root.in"] = tokens["image"] * _input_width(arch) + tokens["text"] * _text_width(arch)
    return feats


def _input_width(arch: ArchSpec) -> int:
    return next(lin.in_features for lin in arch.root if lin.name in ("x_embedder", "patch_embedding"))


def _text_width(arch: ArchSpec) -> int:
    names = ("context_embedder", "condition_embedder.text_embedder.linear_1")
    return next(lin.in_features for lin in arch.root if lin.name in names)


def fit_key(family: str, dtype_bytes: int, checkpointing: bool) -> str:
    """The key of one fitted coefficient set."""
    if dtype_bytes not in DTYPE_NAMES:
        raise UserError(f"no activation fit for a {dtype_bytes}-byte compute dtype (fp32 or bf16 only)")
    return f"{family}/{DTYPE_NAMES[dtype_bytes]}/{'ckpt' if checkpointing else 'plain'}"


def saved_bytes(arch: ArchSpec, tokens: dict[str, int], *, batch: int, dtype_bytes: int,
                checkpointing: bool, fit: dict | None = None) -> int:
    """Bytes autograd keeps for the backward of one forward of ``batch`` samples."""
    if batch < 1:
        raise UserError(f"batch must be >= 1, got {batch}")
    entry = (fit or FIT)[fit_key(arch.family, dtype_bytes, checkpointing)]
    coef = entry["coef"]
    feats = activation_features(arch, tokens, checkpointing)
    missing = sorted(set(feats) - set(coef))
    if missing:
        raise UserError(f"the activation fit {fit_key(arch.family, dtype_bytes, checkpointing)} lacks {missing}")
    return int(batch * max(0.0, sum(coef[name] * value for name, value in feats.items())))


def block_saved_bytes(arch: ArchSpec, tokens: dict[str, int], *, batch: int, dtype_bytes: int,
                      fit: dict | None = None) -> int:
    """Saved bytes of the largest single block without checkpointing (what a checkpointed backward recomputes)."""
    entry = (fit or FIT)[fit_key(arch.family, dtype_bytes, False)]["coef"]
    feats = activation_features(arch, tokens, False)
    best = 0.0
    for block in arch.blocks:
        per = sum(entry.get(name, 0.0) * value for name, value in feats.items() if name.startswith(block.kind + "."))
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
