"""`leangrpo-eval`: evaluate a training checkpoint, or the model a config names, on the eval prompts.

``leangrpo-eval --config CFG [--checkpoint RUN/checkpoints/step_<N>] [--out FILE] [dotted.key=value ...]`` runs the
config's ``eval:`` section (prompts, samples per prompt, steps, noise level, guidance, seed, rewards) once, prints a
table of the rewards and writes one ``eval.jsonl`` object to ``--out``. A run's ``RUN/config.yaml`` is a valid
``--config``. Under ``torchrun --nproc-per-node N -m leangrpo_mcore.eval ...`` the samples are split over the ranks
(the policy laid out as the config's ``parallel`` section says), with the same results as on one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from leangrpo_mcore.cli.common import add_version_flag, run_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``leangrpo-eval``."""
    parser = argparse.ArgumentParser(
        prog="leangrpo-eval",
        description="Evaluate a diffusion policy (a training checkpoint, or the config's model.path) on fixed "
                    "prompts with a deterministic sampler.",
        epilog="Several ranks: torchrun --nproc-per-node N -m leangrpo_mcore.eval --config FILE [...]",
    )
    parser.add_argument("--config", help="YAML experiment config (a run's RUN/config.yaml works); required")
    parser.add_argument("--checkpoint", help="a training checkpoint directory RUN/checkpoints/step_<N> (default: "
                                             "the model that the config's model.path names)")
    parser.add_argument("--out", help="write the result as one JSON object (the eval.jsonl form) to this file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. eval.num_prompts=8")
    return add_version_flag(parser)


def format_table(result: dict) -> str:
    """The rewards of one result as a text table."""
    header = f"{'reward':<28}{'mean':>12}{'std':>12}{'min':>12}{'max':>12}"
    lines = [f"step {result['step']}: {result['num_prompts']} prompts x {result['samples_per_prompt']} samples",
             header, "-" * len(header)]
    for name, stats in result["rewards"].items():
        lines.append(f"{name:<28}" + "".join(f"{stats[k]:>12.4f}" for k in ("mean", "std", "min", "max")))
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is None:
        raise UserError("a config is required: leangrpo-eval --config FILE [--checkpoint DIR] [--out FILE]")
    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise UserError(f"--checkpoint: no such directory: {args.checkpoint}")
    config = load_config(args.config, args.overrides)
    from leangrpo_mcore.engine.launch import quiet_nonzero_ranks

    quiet_nonzero_ranks()
    from leangrpo_mcore.engine.eval_run import evaluate_model

    result = evaluate_model(config, args.checkpoint)
    if result is None:
        return 0
    record_ = result.to_json()
    print(format_table(record_), flush=True)
    if args.out:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(record_, fh, indent=1)
                fh.write("\n")
        except OSError as err:
            raise UserError(f"--out {args.out}: {err.strerror}") from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``leangrpo-eval`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    return run_main(_main, argv)


@record
def launch() -> int | None:
    """The process entry point (``leangrpo-eval``, ``python -m leangrpo_mcore.eval``, torchrun)."""
    return main()


if __name__ == "__main__":
    sys.exit(launch())
