"""Fit the planner's activation-memory constants to measured saved-tensor bytes of real policy forwards.

For each family (FLUX, SD3, Wan, Qwen-Image), compute dtype (fp32, bf16), activation checkpointing (off, on) and training mode (full
fine-tuning; LoRA on the default targets, base frozen) this builds small policies with
``leangrpo_mcore.models.build_policy`` over a grid of widths, heads, MLP widths, depths and token counts, at tensor
parallelism 1 and 2 (TP=2 on a fake process group in this one process: collectives move nothing, the shapes every
rank holds are exact), runs one grad-enabled forward of one sample under ``torch.autograd.graph.saved_tensors_hooks``
and counts the bytes of the unique storages autograd saves on this rank (parameters excluded). A least-squares fit
on the features of :func:`leangrpo_mcore.planner.activations.activation_features` gives the bytes per unit of each
feature.

    python tools/calibrate_activations.py            # print the fit and its residuals
    python tools/calibrate_activations.py --write    # also regenerate leangrpo_mcore/planner/activation_fit.py
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import pprint
import sys
import warnings
from typing import Callable

import numpy as np
import torch

from leangrpo_mcore.models import build_policy
from leangrpo_mcore.models.common.lora import LoRAConfig, apply_lora, mark_only_lora_trainable
from leangrpo_mcore.planner.activations import activation_features, fit_key
from leangrpo_mcore.planner.arch_specs import DEFAULT_LORA_TARGETS, arch_from_config
from leangrpo_mcore.planner.simulate import fake_world

FIT_MODULE = os.path.join(os.path.dirname(__file__), "..", "leangrpo_mcore", "planner", "activation_fit.py")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TP_SIZES = (1, 2)
LORA_RANKS = (4, 8)


def measure_saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the unique non-parameter storages autograd saves while ``forward()`` runs with grad."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()  # kept alive until counted so that no saved storage is freed and its address reused
    total = sum(seen.values())
    del out
    return total


def flux_cases() -> list[tuple[dict, int, int]]:
    """(diffusers config, image tokens, text tokens) of the FLUX grid."""
    cases = []
    for (nd, ns), heads, hd, side, txt, jd in itertools.product(
            [(1, 1), (2, 1), (1, 2)], [2, 4], [16, 32], [4, 8], [8, 16], [32, 64]):
        rope = [hd // 4, 3 * hd // 8, 3 * hd // 8]
        config = {"patch_size": 1, "in_channels": 16, "num_layers": nd, "num_single_layers": ns,
                  "attention_head_dim": hd, "num_attention_heads": heads, "joint_attention_dim": jd,
                  "pooled_projection_dim": 24, "guidance_embeds": True, "axes_dims_rope": rope}
        cases.append((config, side * side, txt))
    return cases


def wan_cases() -> list[tuple[dict, tuple[int, int, int], int]]:
    """(diffusers config, latent (frames, height, width), text tokens) of the Wan grid."""
    cases = []
    for layers, heads, hd, ffn, latent, txt, text_dim in itertools.product(
            [1, 2], [2, 4], [12, 24], [32, 96], [(1, 8, 8), (3, 8, 16)], [8, 16], [16, 32]):
        config = {"patch_size": [1, 2, 2], "num_attention_heads": heads, "attention_head_dim": hd,
                  "in_channels": 4, "out_channels": 4, "text_dim": text_dim, "freq_dim": 8, "ffn_dim": ffn,
                  "num_layers": layers, "rope_max_seq_len": 32}
        cases.append((config, latent, txt))
    return cases


def sd3_cases() -> list[tuple[dict, int, int]]:
    """(diffusers config, image tokens, text tokens) of the SD3 grid: MMDiT-X blocks first, then plain joint blocks,
    then the context-pre-only last block (SD3.5-M's order); every case has blocks of all three kinds."""
    cases = []
    for (layers, dual), heads, hd, side, txt, jd in itertools.product(
            [(3, 1), (4, 1), (4, 2)], [2, 4], [16, 32], [4, 8], [8, 16], [32, 64]):
        config = {"sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": layers, "attention_head_dim": hd,
                  "num_attention_heads": heads, "joint_attention_dim": jd, "caption_projection_dim": heads * hd,
                  "pooled_projection_dim": 24, "out_channels": 16, "pos_embed_max_size": 16,
                  "dual_attention_layers": list(range(dual)), "qk_norm": "rms_norm"}
        cases.append((config, side * side, txt))
    return cases


def qwen_image_cases() -> list[tuple[dict, int, int]]:
    """(diffusers config, image tokens, text tokens) of the Qwen-Image grid (every prompt of a case real: the
    attention runs unmasked, as flash attention does)."""
    cases = []
    for layers, heads, hd, side, txt, jd in itertools.product(
            [1, 2, 3], [2, 4], [16, 32], [4, 8], [8, 16], [32, 64]):
        rope = [hd // 4, 3 * hd // 8, 3 * hd // 8]
        config = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": layers,
                  "attention_head_dim": hd, "num_attention_heads": heads, "joint_attention_dim": jd,
                  "guidance_embeds": False, "axes_dims_rope": rope}
        cases.append((config, side * side, txt))
    return cases


def _qwen_image_sample(config: dict, image: int, text: int, dtype: torch.dtype) -> Callable:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, image, config["in_channels"], generator=gen).to(dtype)
    ctx = torch.randn(1, text, config["joint_attention_dim"], generator=gen).to(dtype)
    side = int(image ** 0.5)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(x, ctx, None, torch.full((1,), 0.5, dtype=dtype), (1, side, side))

    return run


def _sd3_sample(config: dict, image: int, text: int, dtype: torch.dtype) -> Callable:
    gen = torch.Generator().manual_seed(0)
    side = 2 * int(image ** 0.5)  # latent pixels per side: 2x2 patches
    x = torch.randn(1, config["in_channels"], side, side, generator=gen).to(dtype)
    ctx = torch.randn(1, text, config["joint_attention_dim"], generator=gen).to(dtype)
    pooled = torch.randn(1, config["pooled_projection_dim"], generator=gen).to(dtype)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(x, ctx, pooled, torch.full((1,), 500.0, dtype=dtype))

    return run


def _flux_sample(config: dict, image: int, text: int, dtype: torch.dtype) -> Callable:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, image, config["in_channels"], generator=gen).to(dtype)
    ctx = torch.randn(1, text, config["joint_attention_dim"], generator=gen).to(dtype)
    pooled = torch.randn(1, config["pooled_projection_dim"], generator=gen).to(dtype)
    side = int(image ** 0.5)
    img_ids = torch.stack([torch.zeros(image), torch.arange(image) // side, torch.arange(image) % side], dim=1)
    txt_ids = torch.zeros(text, 3)
    one = torch.ones(1, dtype=dtype)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(x, ctx, pooled, 0.5 * one, img_ids, txt_ids, guidance=3.5 * one)

    return run


def _wan_sample(config: dict, latent: tuple[int, int, int], text: int, dtype: torch.dtype) -> Callable:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, config["in_channels"], *latent, generator=gen).to(dtype)
    ctx = torch.randn(1, text, config["text_dim"], generator=gen).to(dtype)

    def run(model: torch.nn.Module) -> torch.Tensor:
        return model(x, torch.full((1,), 500.0, dtype=dtype), ctx)

    return run


IMAGE_GRIDS = {"flux": (flux_cases, _flux_sample), "sd3": (sd3_cases, _sd3_sample),
               "qwen_image": (qwen_image_cases, _qwen_image_sample)}
"""The grid and the sample of each image family."""


def tp_world(tp: int):
    """Megatron's TP groups of size ``tp`` on a fake process group (nothing at TP=1: the single-process build)."""
    return fake_world(world_size=tp, tp=tp) if tp > 1 else contextlib.nullcontext()


def build_case(family: str, config: dict, dtype: torch.dtype, checkpointing: bool, lora_rank: int) -> torch.nn.Module:
    """The policy of one grid case (in the current TP world), LoRA adapters attached and the base frozen if asked."""
    model = build_policy({"family": family, **config, "activation_checkpointing": checkpointing},
                         seed=0, backend="local", dtype=dtype)
    if lora_rank:
        apply_lora(model, LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank, targets=DEFAULT_LORA_TARGETS[family]))
        model.to(dtype)
        mark_only_lora_trainable(model)
    return model


def collect(family: str, dtype: torch.dtype, checkpointing: bool, lora: bool) -> tuple[list[dict], list[int]]:
    """Features and measured saved bytes of every grid case of ``family`` at every TP size."""
    rows, measured = [], []
    if family in IMAGE_GRIDS:
        grid, sample = IMAGE_GRIDS[family]
        cases = [(c, sample(c, i, t, dtype), {"image": i, "text": t}) for c, i, t in grid()]
    else:
        cases = [(c, _wan_sample(c, lat, t, dtype), {"image": lat[0] * lat[1] * lat[2] // 4, "text": t})
                 for c, lat, t in wan_cases()]
    for tp in TP_SIZES:
        with tp_world(tp):
            # each TP size measures every other case of the grid (alternating), which keeps the features apart
            for n, (config, run, counts) in enumerate(cases):
                if n % len(TP_SIZES) != tp % len(TP_SIZES):
                    continue
                rank = LORA_RANKS[(n // len(TP_SIZES)) % len(LORA_RANKS)] if lora else 0
                model = build_case(family, config, dtype, checkpointing, rank)
                tokens = {**counts, "joint": counts["image"] + counts["text"], "sample": 1}
                rows.append(activation_features(arch_from_config(family, config), tokens, checkpointing, tp=tp,
                                                lora_rank=rank))
                measured.append(measure_saved_bytes(model, lambda: run(model)))
    return rows, measured


def fit(rows: list[dict], measured: list[int]) -> dict:
    """Least-squares coefficients (bytes per feature unit) and the residuals of the fit."""
    names = sorted(rows[0])
    a = np.array([[row[n] for n in names] for row in rows], dtype=np.float64)
    b = np.array(measured, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    rel = np.abs(a @ coef - b) / b
    return {"coef": {n: round(float(c), 4) for n, c in zip(names, coef)}, "cases": len(rows),
            "max_rel_err": round(float(rel.max()), 4), "mean_rel_err": round(float(rel.mean()), 4)}


def render_module(fits: dict) -> str:
    """Source of ``leangrpo_mcore/planner/activation_fit.py`` holding ``fits``."""
    header = (
        '"""Fitted activation-memory constants of the layout planner (generated: do not edit by hand).\n\n'
        "Regenerate with ``python tools/calibrate_activations.py --write``. Each entry maps\n"
        "``<family>/<compute dtype>/<plain|ckpt>`` to bytes per unit of each feature of\n"
        ":func:`leangrpo_mcore.planner.activations.activation_features`, least-squares fitted to the saved-tensor\n"
        "bytes (unique storages, parameters excluded) of grad-enabled forwards of the policies (local backend,\n"
        f"CPU, torch {torch.__version__.split('+')[0]}) over a grid of small configs; ``max_rel_err`` / "
        "``mean_rel_err`` are\nthe fit's relative residuals on that grid.\n"
        '"""\n\n'
    )
    return header + "FIT = " + pprint.pformat(fits, width=110, sort_dicts=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure, fit, print; with ``--write`` regenerate the constants module."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate leangrpo_mcore/planner/activation_fit.py")
    parser.add_argument("--family", choices=("flux", "sd3", "wan", "qwen_image"), action="append",
                        help="only these families")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    fits = {}
    for family in args.family or ["flux", "sd3", "wan", "qwen_image"]:
        for dtype_name, checkpointing, lora in itertools.product(DTYPES, (False, True), (False, True)):
            rows, measured = collect(family, DTYPES[dtype_name], checkpointing, lora)
            key = fit_key(family, torch.tensor([], dtype=DTYPES[dtype_name]).element_size(), checkpointing, lora)
            fits[key] = fit(rows, measured)
            print(f"{key}: {fits[key]}", flush=True)
    if args.write:
        from leangrpo_mcore.planner.activation_fit import FIT

        fits = {**FIT, **fits}
        with open(FIT_MODULE, "w", encoding="utf-8") as fh:
            fh.write(render_module(fits))
        print(f"wrote {os.path.normpath(FIT_MODULE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
