"""`leangrpo-convert`: convert transformer checkpoints between diffusers and our policy format.

  leangrpo-convert diffusers-to-mcore --model {flux,qwen_image,sd3,wan} --src DIFFUSERS_TRANSFORMER_DIR --dst DIR
  leangrpo-convert mcore-to-diffusers --src DIR --dst DIR [--keep-lora]

The diffusers side is a transformer directory (``config.json`` + ``*.safetensors``, sharded index
supported), or for Wan2.2-A14B's two experts the pipeline root (``transformer/``, ``transformer_2/`` and the
``boundary_ratio`` of ``model_index.json``), which an export writes back in the same layout. Our format records
the model config and FULL tensors, and loads at any TP size. On export LoRA adapters are merged into the base
weights (in float32, rounded once to the export dtype), unless
``--keep-lora``: then the base weights stay unmerged and the adapters go to ``pytorch_lora_weights.safetensors``
(PEFT key names with the ``transformer.`` prefix; the ``alpha / rank`` scale is folded into ``lora_B``), which
diffusers loads through ``peft``: ``pip install 'leangrpo_mcore[lora]'``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from leangrpo_mcore.cli.common import add_version_flag, run_main
from leangrpo_mcore.errors import UserError

LORA_FILE = "pytorch_lora_weights.safetensors"
_LORA_MARKERS = (".lora_A.", ".lora_B.")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="leangrpo-convert",
        description="Convert transformer checkpoints between diffusers and the leangrpo_mcore format.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    to_ours = sub.add_parser("diffusers-to-mcore", help="diffusers transformer dir -> our checkpoint")
    to_ours.add_argument("--model", required=True, choices=("flux", "qwen_image", "sd3", "wan"),
                         help="model family of --src")
    to_ours.add_argument("--src", required=True, help="diffusers transformer directory (config.json + *.safetensors), "
                                                      "or a two-expert pipeline root (transformer/, transformer_2/)")
    to_ours.add_argument("--dst", required=True, help="output directory (our format)")
    to_ours.add_argument("--overwrite", action="store_true", help="write into a non-empty --dst")
    to_diffusers = sub.add_parser("mcore-to-diffusers", help="our checkpoint -> diffusers transformer dir")
    to_diffusers.add_argument("--src", required=True, help="our checkpoint directory")
    to_diffusers.add_argument("--dst", required=True, help="output diffusers transformer directory")
    to_diffusers.add_argument("--keep-lora", action="store_true",
                              help=f"keep adapters unmerged, written to {LORA_FILE}")
    to_diffusers.add_argument("--overwrite", action="store_true", help="write into a non-empty --dst")
    to_diffusers.add_argument("--no-verify", action="store_true",
                              help="read a training checkpoint without checking it against its COMPLETE marker "
                                   "(by default a damaged or incomplete one is refused)")
    to_diffusers.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                              help="dtype of the exported weights (default: the master weights' dtype, e.g. "
                                   "float32: for merged LoRA adapters the adapters' dtype, else as stored)")
    return add_version_flag(parser)


def _progress(keys: list[str], desc: str):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silent in pipes and CI logs.
    return tqdm(keys, desc=desc, unit="tensor", disable=None, file=sys.stderr)


def _read_all(source, desc: str) -> dict[str, torch.Tensor]:
    return {key: source.get(key) for key in _progress(source.keys(), desc)}


def _check_dst(dst: str, overwrite: bool) -> None:
    path = Path(dst)
    if path.exists() and not path.is_dir():
        raise UserError(f"--dst {dst} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"--dst {dst} is not empty (pass --overwrite to write into it)")


def diffusers_to_mcore(model: str, src: str, dst: str, *, overwrite: bool = False) -> Path:
    """Convert a diffusers transformer directory of family ``model`` into our format at ``dst``."""
    from leangrpo_mcore.models.common import checkpoint as ckpt
    from leangrpo_mcore.models.registry import get_family

    family = get_family(model)
    hyper, source = ckpt.read_diffusers_dir(src)
    class_name = hyper.get("_class_name")
    if class_name != family.diffusers_class_name:
        raise UserError(f"{src} holds a {class_name or 'model without _class_name'}, not a "
                        f"{family.diffusers_class_name} (--model {model})")
    _check_dst(dst, overwrite)
    config = family.config_cls.from_diffusers_config(hyper)
    tensors = family.diffusers_to_mcore(_read_all(source, "reading"), config)
    return ckpt.write_policy_checkpoint(dst, family=family.name, config=config.to_diffusers_config(), lora=None,
                                        tensors=tensors)


def _split_lora(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    base = {k: v for k, v in tensors.items() if not any(m in k for m in _LORA_MARKERS)}
    hosts = sorted({k.split(".lora_A.")[0] for k in tensors if ".lora_A." in k})
    adapters = {}
    for host in hosts:
        a, b = f"{host}.lora_A.weight", f"{host}.lora_B.weight"
        if a not in tensors or b not in tensors:
            raise UserError(f"checkpoint has an incomplete LoRA adapter at {host}")
        adapters[host] = (tensors[a], tensors[b])
    if len(base) + 2 * len(adapters) != len(tensors):
        raise UserError("checkpoint has LoRA tensors without a matching lora_A / lora_B pair")
    return base, adapters


def adapters_in_diffusers_terms(family, config, adapters: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{diffusers linear name: (A, B)}`` from ``{our host name: (A, B)}``, through the family's plan.

    A host that is one stored tensor keeps its factors; a host whose weight interleaves its input columns
    (FLUX's single-block ``proj_out``) has A's columns put back in diffusers' order; a LoRA slot of a fused
    projection (``attn.to_q``) has no weight of its own and is diffusers' linear of the same name.
    """
    from leangrpo_mcore.models.common.assembly import disassemble, with_leading

    plan = family.diffusers_plan(config)
    rename = family.name_to_diffusers or (lambda name: name)
    out = {}
    for host, (a, b) in adapters.items():
        weight = plan.get(f"{host}.weight")
        keys = [] if weight is None else sorted({piece.key for piece in weight.pieces})
        if weight is None:
            out[rename(f"{host}.weight")[: -len(".weight")]] = (a, b)
        elif len(weight.pieces) == 1:
            out[keys[0][: -len(".weight")]] = (a, b)
        elif weight.dim == 1 and len(keys) == 1:
            layout = with_leading(weight, a.shape[0], lambda key: key)
            out[keys[0][: -len(".weight")]] = (disassemble({"A": a}, {"A": layout}, "LoRA A")[keys[0]], b)
        else:
            raise UserError(f"cannot name the adapter of {host} in diffusers terms")
    return out


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict, scaling: float,
                   dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Base tensors with ``W + scaling * B @ A`` folded in, computed in float32 (the same formula as merge_lora; a
    convolution kernel takes the product in its own shape) and rounded once, to ``dtype``: by default the
    adapters' dtype, i.e. the master weights' (a bf16 frozen base would otherwise round away much of the
    trained update)."""
    merged = dict(base)
    for host, (a, b) in adapters.items():
        weight = base[f"{host}.weight"]
        delta = ((b.float() @ a.float()) * scaling).reshape(weight.shape)
        merged[f"{host}.weight"] = (weight.float() + delta).to(dtype or a.dtype)
    return merged


def export_dtype(adapters: dict, keep_lora: bool, dtype: Optional[str]) -> Optional[torch.dtype]:
    """The dtype of the exported weights: ``--dtype``; else, for merged adapters, the master weights' (the
    adapters', which the optimizer trains; the frozen base may be stored in the compute dtype); else as stored
    (None)."""
    if dtype is not None:
        return DTYPES[dtype]
    if adapters and not keep_lora:
        return next(iter(adapters.values()))[0].dtype
    return None


def mcore_to_diffusers(src: str, dst: str, *, keep_lora: bool = False, overwrite: bool = False,
                       dtype: Optional[str] = None, verify: bool = True) -> Path:
    """Export our checkpoint at ``src`` (a policy directory or a training checkpoint ``step_<N>``) as a diffusers
    transformer directory at ``dst``, in ``dtype`` (default: the master weights' dtype, see
    :func:`export_dtype`). A training checkpoint is first checked against its ``COMPLETE`` marker (unless not
    ``verify``), then read one tensor at a time from its sharded files, without its optimizer state and without a
    launch."""
    from leangrpo_mcore.engine.checkpoint.verify import verify_before_reading
    from leangrpo_mcore.models.common import checkpoint as ckpt
    from leangrpo_mcore.models.registry import get_family

    verify_before_reading(src, "--src", enabled=verify, switch="--no-verify")
    meta, source = ckpt.read_policy_checkpoint(src)
    family = get_family(meta["family"])
    config = family.config_cls.from_diffusers_config(meta["config"])
    _check_dst(dst, overwrite)
    base, adapters = _split_lora(_read_all(source, "reading"))
    lora = meta.get("lora")
    if adapters and not lora:
        raise UserError(f"{src} holds LoRA tensors but its metadata has no lora entry")
    scaling = float(lora["alpha"]) / float(lora["rank"]) if lora else 1.0
    converted = family.mcore_to_diffusers(base, config)
    # Adapters move to diffusers' linears first; there every adapter is a plain pair on one weight.
    adapters = adapters_in_diffusers_terms(family, config, adapters)
    missing = sorted(host for host in adapters if f"{host}.weight" not in converted)
    if missing:
        raise UserError(f"cannot name the adapter of {missing[0]} in diffusers terms")
    target = export_dtype(adapters, keep_lora, dtype)
    if adapters and not keep_lora:
        converted = merge_adapters(converted, adapters, scaling, dtype=target)
    if target is not None:
        converted = {k: v.to(target) if v.is_floating_point() else v for k, v in converted.items()}
    folder = ckpt.write_diffusers_dir(dst, class_name=family.diffusers_class_name,
                                      config=config.to_diffusers_config(), tensors=converted,
                                      pipeline_class=getattr(config, "diffusers_pipeline", None))
    if adapters and keep_lora:
        _write_peft(folder, adapters, scaling, experts=getattr(config, "boundary_ratio", None) is not None)
    return folder


def _write_peft(folder: Path, adapters: dict, scaling: float, *, experts: bool) -> None:
    """The adapters as PEFT tensors (``transformer.`` prefix, the scale folded into B): one file, or with two
    experts one in each expert's component folder (diffusers loads the second with ``load_into_transformer_2``)."""
    from leangrpo_mcore.models.common import checkpoint as ckpt

    places = {f"{c}.": folder / c for c in ckpt.EXPERT_COMPONENTS} if experts else {"": folder}
    for prefix, place in places.items():
        peft = {}
        for host, (a, b) in adapters.items():
            if prefix and not host.startswith(prefix):
                continue
            name = host[len(prefix):]
            peft[f"transformer.{name}.lora_A.weight"] = a
            peft[f"transformer.{name}.lora_B.weight"] = (b.float() * scaling).to(b.dtype)
        if peft:
            ckpt.save_safetensors(peft, place / LORA_FILE, metadata={"format": "pt"})


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "diffusers-to-mcore":
            out = diffusers_to_mcore(args.model, args.src, args.dst, overwrite=args.overwrite)
        else:
            out = mcore_to_diffusers(args.src, args.dst, keep_lora=args.keep_lora, overwrite=args.overwrite,
                                     dtype=args.dtype, verify=not args.no_verify)
    except UserError:
        raise
    except ValueError as err:  # a config or state dict of the wrong kind, reported by the family code
        raise UserError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leangrpo-convert``; returns the exit code (2 for bad input)."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
