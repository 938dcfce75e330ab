"""Benchmark the Native, Retain and Reweight schedules side by side (same as `leangrpo-bench`).

  python tools/benchmark_schedules.py --config yaml_configs/bench/flux_flowgrpo.yaml --steps 5 --warmup 1 \
      --json runs/bench.json --markdown runs/bench.md --plot runs/bench.png
  torchrun --standalone --nproc-per-node 2 tools/benchmark_schedules.py --config ... (rank 0 reports)
"""

import sys

from leangrpo_mcore.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
