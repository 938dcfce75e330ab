"""Measure ``reward.async_scoring`` against a deliberately slow reward server.

Starts ``tools/reward_server_example.py --delay-s D`` (every batch takes D seconds more to score), then trains
the config through ``reward.name=remote`` with background scoring off and on, alternating, ``--repeats`` times
each, every launch a fresh process with one thread. Prints a Markdown table of the medians over the steps after
the first of every launch (step time and the rollout / reward phases), and whether the two modes logged the
same metrics (times aside)::

    python tools/bench_async_scoring.py --config yaml_configs/tiny/flux.yaml --delay-s 0.1 --steps 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time_step_s", "time_rollout_s", "time_reward_s")
MODES = ("false", "true")


def _start_server(delay_s: float, max_concurrent: int) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, str(ROOT / "tools" / "reward_server_example.py"), "--port", "0",
                               "--delay-s", str(delay_s), "--max-concurrent", str(max_concurrent)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = server.stdout.readline().strip()  # "serving reward '...' on http://127.0.0.1:PORT/"
    if " on " not in line:
        server.kill()
        raise SystemExit(f"the reward server did not start: {line!r}")
    return server, line.rsplit(" on ", 1)[1]


def _train(config: str, url: str, mode: str, steps: int, out: Path, extra: Sequence[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "leangrpo_mcore.train", "--config", config, "reward.name=remote",
           f"reward.url={url}", f"reward.async_scoring={mode}", f"train.max_steps={steps}",
           f"train.output_dir={out}", "train.overwrite=true", "checkpoint.save_every=0", "logging.tensorboard=false",
           *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"training failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a: list[dict], b: list[dict]) -> bool:
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time_", "max_rss"))} for r in rows]
    return strip(a) == strip(b)


def summarize(runs: dict[str, list[list[dict]]]) -> str:
    """A Markdown table of the medians per mode over every launch's steps after the first."""
    lines = ["| async_scoring | steps | step s | rollout s | reward s |", "| --- | ---: | ---: | ---: | ---: |"]
    medians = {}
    for mode, launches in runs.items():
        rows = [row for launch in launches for row in launch[1:]]
        medians[mode] = [statistics.median(float(r.get(p, 0.0)) for r in rows) for p in PHASES]
        lines.append(f"| {mode} | {len(rows)} | " + " | ".join(f"{v:.3f}" for v in medians[mode]) + " |")
    if set(medians) == set(MODES):
        off, on = medians["false"][0], medians["true"][0]
        lines.append("")
        lines.append(f"step time: {off:.3f} s -> {on:.3f} s ({off / on:.2f}x)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="yaml_configs/tiny/flux.yaml")
    parser.add_argument("--delay-s", type=float, default=0.1, help="seconds the server adds to every batch")
    parser.add_argument("--max-concurrent", type=int, default=2, help="batches the server scores at once")
    parser.add_argument("--steps", type=int, default=8, help="steps per launch (the first is not counted)")
    parser.add_argument("--repeats", type=int, default=3, help="launches per mode, alternating")
    parser.add_argument("--out", default="runs/async_bench", help="run directories go here")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value) for every launch")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 and --repeats >= 1")
    server, url = _start_server(args.delay_s, args.max_concurrent)
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
    try:
        for repeat in range(args.repeats):
            for mode in MODES:
                out = ROOT / args.out / f"async_{mode}_{repeat}"
                runs[mode].append(_train(args.config, url, mode, args.steps, out, args.overrides))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"{args.config}, server delay {args.delay_s} s per batch, {args.repeats} launches x {args.steps} steps "
          f"per mode; overrides: {' '.join(args.overrides) or 'none'}")
    print(summarize(runs))
    same = all(_same(a, b) for a, b in zip(runs["false"], runs["true"]))
    print(f"metrics identical between the modes (times aside): {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
