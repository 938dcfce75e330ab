"""`leangrpo-plan`: Plan the schedule, TP/FSDP degrees and prompt-group placement for a cluster."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from leangrpo_mcore.cli.common import not_implemented, run_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leangrpo-plan", description="Plan the schedule, TP/FSDP degrees and prompt-group placement for a cluster.")
    parser.add_argument("--config", help="YAML experiment config")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser


def _main(argv: Sequence[str] | None) -> int:
    build_parser().parse_args(argv)
    return not_implemented("leangrpo-plan", 6)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
