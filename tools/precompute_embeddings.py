"""Precompute the text embeddings of a prompt set into a cache for ``model.text_encoder=precomputed``.

The training run then never loads the text encoders (DanceGRPO precomputes its T5 states the same way)::

    python tools/precompute_embeddings.py --family flux --text-encoder-path /models/FLUX.1-dev \\
        --prompts prompts.txt --out /data/flux_embeddings
    leangrpo-train --config ... model.text_encoder=precomputed model.text_encoder_path=/data/flux_embeddings

For Wan with classifier-free guidance add ``--negative-prompt ""`` (or the run's negative prompt) so that its
embedding is cached too; Qwen-Image's cache (``--family qwen_image --max-length 256``) keeps each prompt's token
mask beside its states. ``--encoder hashed`` caches the tiny hashed embedder instead (tests, demos).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from leangrpo_mcore.cli.common import run_main
from leangrpo_mcore.data.conditioning import FAMILIES, T5_MAX_LENGTH, HashedTextEncoder, TextDims, TextEncoder
from leangrpo_mcore.data.text_encoder import POOLED_FAMILIES
from leangrpo_mcore.data.embedding_cache import write_embedding_cache
from leangrpo_mcore.data.prompts import PromptDataset
from leangrpo_mcore.errors import UserError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True, help="policy family the embeddings are for")
    parser.add_argument("--prompts", required=True, help="'builtin', a .txt or a .jsonl prompt file")
    parser.add_argument("--out", required=True, help="cache directory to write")
    parser.add_argument("--encoder", choices=("diffusers", "hashed"), default="diffusers", help="embedder to run")
    parser.add_argument("--text-encoder-path", help="diffusers pipeline directory (for --encoder diffusers)")
    parser.add_argument("--text-dim", type=int, help="token width D (for --encoder hashed)")
    parser.add_argument("--pooled-dim", type=int, help="pooled width P (for --encoder hashed, flux, sd3)")
    parser.add_argument("--max-length", type=int, default=T5_MAX_LENGTH,
                        help="tokens per prompt (T5/UMT5; SD3: 77 CLIP + T5's; Qwen-Image: the most kept)")
    parser.add_argument("--negative-prompt", default=None,
                        help="also cache this negative prompt (Wan, SD3, Qwen-Image CFG)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="storage dtype")
    parser.add_argument("--device", default="cpu", help="device of the text encoders")
    parser.add_argument("--shard-size", type=int, default=256, help="prompts per safetensors shard")
    parser.add_argument("--seed", type=int, default=0, help="hashed embedder seed")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing cache")
    return parser


def _encoder(args: argparse.Namespace) -> TextEncoder:
    if args.encoder == "hashed":
        if args.text_dim is None or (args.family in POOLED_FAMILIES and args.pooled_dim is None):
            raise UserError("--encoder hashed needs --text-dim (and --pooled-dim for flux and sd3)")
        pooled = args.pooled_dim if args.family in POOLED_FAMILIES else None
        return HashedTextEncoder(args.family, TextDims(args.text_dim, pooled, args.max_length), seed=args.seed)
    if not args.text_encoder_path:
        raise UserError("--encoder diffusers needs --text-encoder-path")
    from leangrpo_mcore.data.diffusers_text import DiffusersTextEncoder, pipeline_text_dims

    dims = pipeline_text_dims(args.text_encoder_path, args.family, max_length=args.max_length)
    return DiffusersTextEncoder(args.text_encoder_path, args.family, dims, device=args.device)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = _parser().parse_args(argv)
    prompts = PromptDataset.from_source(args.prompts).prompts
    if args.negative_prompt is not None:
        prompts.append(args.negative_prompt)
    encoder = _encoder(args)
    description = f"{args.encoder}:{args.text_encoder_path or f'seed={args.seed}'}"
    with tqdm(total=len(set(prompts)), unit="prompt", desc="embedding", disable=None) as bar:
        index = write_embedding_cache(
            encoder, prompts, args.out, shard_size=args.shard_size, dtype=_DTYPES[args.dtype],
            description=description, overwrite=args.overwrite, on_shard=lambda done, _: bar.update(done - bar.n),
        )
    print(f"wrote {len(set(prompts))} embeddings to {index.parent}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: one-line errors and exit code 2 for bad input."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
