"""`leangrpo-bench`: Benchmark the Native, Retain and Reweight schedules side by side.

``leangrpo-bench --config FILE --schedules native,retain,reweight --steps N --warmup W [--json OUT]
[--markdown OUT] [--plot OUT.png] [--sweep KEY=V1,V2,...] [--no-baselines] [dotted.key=value ...]`` runs the
schedules on the same config within one launch, interleaved, from identical weights (see
:mod:`leangrpo_mcore.bench.runner`), and with several data-parallel ranks every Native the project can run on
them (sharded and replicated, per-backward and coalesced sync), to report each speedup over the best of them.
Under ``torchrun --nproc-per-node N -m leangrpo_mcore.cli.bench ...`` every rank runs it; rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from leangrpo_mcore.cli.common import add_version_flag, run_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``leangrpo-bench``."""
    parser = argparse.ArgumentParser(
        prog="leangrpo-bench", description="Benchmark the Native, Retain and Reweight schedules side by side.",
        epilog="Several ranks: torchrun --nproc-per-node N -m leangrpo_mcore.cli.bench --config FILE ...")
    parser.add_argument("--config", required=True, help="YAML experiment config (see yaml_configs/bench/)")
    parser.add_argument("--schedules", default="native,retain,reweight",
                        help="comma-separated, run interleaved in this order: native, native_coalesced, retain, "
                             "reweight, reweight_affine, each on the config's layout or NAME@sharded / "
                             "NAME@replicated (default: native,retain,reweight)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per schedule (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded steps per schedule first (default 1)")
    parser.add_argument("--json", help="write the full report (every step, every phase) to this JSON file")
    parser.add_argument("--markdown", help="write the report tables to this Markdown file")
    parser.add_argument("--plot", help="write stacked phase bars per schedule to this PNG file")
    parser.add_argument("--sweep", help="KEY=V1,V2,...: one benchmark run per value of a dotted config key")
    parser.add_argument("--no-memory", action="store_true", help="skip the untimed peak-memory step per schedule")
    parser.add_argument("--no-baselines", action="store_true",
                        help="time only --schedules: not also every Native layout and sync they leave out (with "
                             "several data-parallel ranks each layout holds its own copy of the policy)")
    parser.add_argument("--check-parity", action="store_true",
                        help="one more untimed step per schedule: its gradient against Native's (cosine, rel. L2)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    return add_version_flag(parser)


def _sweep_points(sweep: str | None) -> tuple[str | None, list[str]]:
    if sweep is None:
        return None, [""]
    key, sep, values = sweep.partition("=")
    points = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not points:
        raise UserError(f"--sweep takes KEY=V1,V2,... (a dotted config key and its values), got {sweep!r}")
    return key.strip(), points


def _write(document: dict, args: argparse.Namespace) -> str:
    from leangrpo_mcore.bench.plot import plot_document
    from leangrpo_mcore.bench.report import document_markdown

    markdown = document_markdown(document)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown, encoding="utf-8")
    if args.plot:
        plot_document(document, args.plot, title=f"{args.config}: mean step time by phase")
    return markdown


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    key, values = _sweep_points(args.sweep)
    configs = [load_config(args.config, [*args.overrides, *([f"{key}={v}"] if key else [])]) for v in values]
    from leangrpo_mcore.bench.runner import BenchOptions, bench_document, parse_schedules, run_benchmark
    from leangrpo_mcore.engine.build import resolve_plan
    from leangrpo_mcore.engine.launch import get_logger, init_distributed, shutdown, user_errors
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    with user_errors():
        schedules = tuple(parse_schedules(args.schedules))
        BenchOptions(schedules=schedules, steps=args.steps, warmup=args.warmup, check_parity=args.check_parity)
    dist_ctx = init_distributed()
    logger = get_logger(dist_ctx.rank)
    try:
        runs = []
        for value, config in zip(values, configs):
            title = " ".join([args.config, *args.overrides, *([f"{key}={value}"] if key else [])])
            options = BenchOptions(schedules=schedules, steps=args.steps, warmup=args.warmup,
                                   measure_memory=not args.no_memory, check_parity=args.check_parity, title=title,
                                   baselines=not args.no_baselines)
            logger.info("benchmarking %s: %s", title, ", ".join(schedules))
            with user_errors():
                # the config's own layout is the trainer's: its auto keys resolved by the planner for this world
                config = resolve_plan(config, dist_ctx, logger)
                runs.append(run_benchmark(config, options, dist_ctx))
        document = bench_document(runs, key, values if key else None)
        if dist_ctx.is_main:
            print(_write(document, args), end="", flush=True)
    finally:
        destroy_parallel_context()
        shutdown(dist_ctx)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``leangrpo-bench`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code (see :func:`launch`)."""
    return run_main(_main, argv)


@record
def launch() -> int | None:
    """The process entry point (``leangrpo-bench``, torchrun): :func:`main` under torchrun's ``record``."""
    return main()


if __name__ == "__main__":
    sys.exit(launch())
