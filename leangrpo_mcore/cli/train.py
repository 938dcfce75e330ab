"""`leangrpo-train`: Train a diffusion policy with GRPO (Native, Retain or Reweight schedule)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from leangrpo_mcore.cli.common import not_implemented, run_main
from leangrpo_mcore.config import load_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leangrpo-train", description="Train a diffusion policy with GRPO (Native, Retain or Reweight schedule).")
    parser.add_argument("--config", help="YAML experiment config")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is not None or args.overrides:
        load_config(args.config, args.overrides)
    return not_implemented("leangrpo-train", 5)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
