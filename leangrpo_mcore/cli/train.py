"""`leangrpo-train`: Train a diffusion policy with GRPO (Native, Retain or Reweight schedule).

``leangrpo-train --config FILE [dotted.key=value ...]`` runs one process; under
``torchrun --nproc-per-node N -m leangrpo_mcore.train --config FILE ...`` every rank runs the same command.
Bad input ends with one ``error: ...`` line (printed by the first rank that fails) and exit code 2 on every
rank; torchrun then prints its failure summary, with that line as each failed rank's message, and exits with 1.
A preemption signal (``train.save_on_signal``) ends the run after a checkpoint with 128 + the signal number
(143 for SIGTERM); a stall caught by the step watchdog (``train.step_timeout_minutes``) with 124, and so does a
collective that ran into the process-group timeout (``parallel.timeout_minutes``, one ``error:`` line naming it).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from leangrpo_mcore.cli.common import add_version_flag, run_main
from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import CollectiveTimeoutError, UserError


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``leangrpo-train``."""
    parser = argparse.ArgumentParser(
        prog="leangrpo-train",
        description="Train a diffusion policy with GRPO (Native, Retain or Reweight schedule).",
        epilog="Multi-GPU / multi-node: torchrun --nproc-per-node N [--nnodes ...] -m leangrpo_mcore.train "
               "--config FILE [overrides]. Set LEANGRPO_TRACEBACK=1 to see the traceback of an input error.",
    )
    parser.add_argument("--config", help="YAML experiment config (see yaml_configs/); required")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=5")
    return add_version_flag(parser)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is None:
        raise UserError("a config is required: leangrpo-train --config FILE [dotted.key=value ...] "
                        "(examples in yaml_configs/)")
    config = load_config(args.config, args.overrides)
    from leangrpo_mcore.engine.launch import quiet_nonzero_ranks

    quiet_nonzero_ranks()
    from leangrpo_mcore.engine.launch import explain_timeout
    from leangrpo_mcore.engine.control.preemption import exit_code
    from leangrpo_mcore.engine.trainer import train

    try:
        state = train(config)
    except RuntimeError as err:
        line = explain_timeout(err, config.parallel.timeout_minutes * 60.0)
        if line is None or os.environ.get("LEANGRPO_TRACEBACK") == "1":
            raise
        raise CollectiveTimeoutError(line) from None
    return exit_code(state.stopped_by_signal) if state.stopped_by_signal else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``leangrpo-train`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code (see :func:`launch`)."""
    return run_main(_main, argv)


@record
def launch() -> int | None:
    """The process entry point (``leangrpo-train``, ``python -m leangrpo_mcore.train``, torchrun): :func:`main` on
    ``sys.argv`` under torchrun's ``record``, so that a crash's traceback also reaches torchrun's error file."""
    return main()


if __name__ == "__main__":
    sys.exit(launch())
