"""Benchmark the update schedules side by side: interleaved steps, phase breakdown, memory, ideal ratio."""

from leangrpo_mcore.bench.report import PHASES, ideal_ratio, split_phases, spread
from leangrpo_mcore.bench.runner import VARIANTS, BenchOptions, bench_document, parse_schedules, run_benchmark

__all__ = ["PHASES", "VARIANTS", "BenchOptions", "bench_document", "ideal_ratio", "parse_schedules", "run_benchmark",
           "split_phases", "spread"]
