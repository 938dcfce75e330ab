"""Peak host memory per rank when a run starts from a diffusers checkpoint and when it saves a checkpoint.

  python tools/bench_host_memory.py --workdir /tmp/rss --layers 2 --single-layers 4 --nproc 2

writes (once) a FLUX-architecture diffusers checkpoint with FLUX.1-dev's widths and the given block counts
(random bf16 weights, sharded files plus an index, as diffusers ships them), then launches ``--nproc`` ranks
with torchrun. Each rank builds the trainer from ``yaml_configs/tiny/flux.yaml`` with ``model.path`` set to it
(full fine-tune, fp32 master weights, FSDP2 over the ranks) and records its peak resident memory after the
start; creates the AdamW state with one zero-gradient step (a CPU rollout of a billion-parameter model is not
what this measures); then samples its resident memory every 5 ms while it writes a checkpoint. The same
start with the tiny preset gives the fixed overhead of a rank (Python, torch, megatron-core, data side).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_checkpoint(dst: Path, layers: int, single_layers: int, shard_bytes: int = 1 << 30) -> int:
    """A random bf16 diffusers FLUX checkpoint of FLUX.1-dev's widths; returns its parameter count."""
    import torch
    from tqdm import tqdm

    from leangrpo_mcore.models import get_family, resolve_model_config
    from leangrpo_mcore.models.common import checkpoint as ckpt
    from leangrpo_mcore.models.common.assembly import stored_shapes

    family, config = resolve_model_config({"preset": "flux-dev", "num_layers": layers,
                                           "num_single_layers": single_layers})
    shapes = stored_shapes(get_family("flux").diffusers_plan(config))
    total = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if (dst / ckpt.DIFFUSERS_INDEX).is_file():
        return total
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    weight_map, part, size, index = {}, {}, 0, 0

    def flush() -> None:
        nonlocal part, size, index
        if part:
            name = f"diffusion_pytorch_model-{index:05d}.safetensors"
            ckpt.save_safetensors(part, dst / name)
            weight_map.update({k: name for k in part})
            part, size, index = {}, 0, index + 1

    for key, shape in tqdm(sorted(shapes.items()), desc="writing", unit="tensor", disable=None):
        part[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += part[key].numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (dst / ckpt.DIFFUSERS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (dst / ckpt.DIFFUSERS_CONFIG).write_text(json.dumps({"_class_name": family.diffusers_class_name,
                                                          **config.to_diffusers_config()}))
    return total


def worker(out: str, model_path: str | None, run_dir: str) -> None:
    """One rank: start, create the optimizer state, save; write the measurements to ``out``_<rank>.json."""
    import torch

    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine.launch import get_logger, init_distributed
    from leangrpo_mcore.engine.trainer import Trainer

    overrides = [f"train.output_dir={run_dir}", "train.overwrite=true", "logging.progress_bar=false",
                 "logging.tensorboard=false"]
    if model_path:
        overrides.append(f"model.path={model_path}")
    dist_ctx = init_distributed()
    trainer = Trainer(load_config(CONFIG, overrides), dist_ctx, get_logger(dist_ctx.rank))
    start_peak = _peak()
    params = [p for p in trainer.parts.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.parts.optimizer.step()
    for p in params:
        p.grad = None
    before_save, samples, done = _rss(), [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    began = time.perf_counter()
    trainer._save(1)
    seconds = time.perf_counter() - began
    done.set()
    thread.join()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.parts.policy.parameters())
    record = {"rank": dist_ctx.rank, "start_peak_bytes": start_peak, "rss_before_save_bytes": before_save,
              "save_peak_bytes": max(samples + [before_save]), "save_seconds": seconds,
              "local_parameters": local}
    Path(f"{out}_{dist_ctx.rank}.json").write_text(json.dumps(record))


def _launch(nproc: int, out: Path, model_path: str | None, run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", str(out)] + (["--model-path", model_path] if model_path else []) + \
          ["--run-dir", str(run_dir)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return [json.loads(Path(f"{out}_{r}.json").read_text()) for r in range(nproc)]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/leangrpo_host_memory")
    parser.add_argument("--layers", type=int, default=2, help="FLUX double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=4, help="FLUX single-stream blocks")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model_path, args.run_dir)
        return 0
    work = Path(args.workdir)
    ckpt_dir = work / f"flux_{args.layers}x{args.single_layers}"
    params = write_checkpoint(ckpt_dir, args.layers, args.single_layers)
    base = _launch(args.nproc, work / "tiny", None, work / "run_tiny")
    big = _launch(args.nproc, work / "big", str(ckpt_dir), work / "run_big")
    model_fp32 = params * 4
    state = model_fp32 * 3  # fp32 master weights + AdamW exp_avg + exp_avg_sq
    overhead = max(r["start_peak_bytes"] for r in base)
    print(f"FLUX architecture, {args.layers} double + {args.single_layers} single blocks at FLUX.1-dev widths: "
          f"{params / 1e9:.3f} B parameters, {_gb(model_fp32)} in fp32; {args.nproc} ranks (FSDP2)")
    print(f"fixed overhead of a rank (tiny preset, same start): {_gb(overhead)}")
    print("| rank | start peak | limit 0.6 x fp32 model + overhead | save peak | limit 0.6 x (model + AdamW) "
          "| save time |")
    print("|---|---|---|---|---|---|")
    for r in big:
        print(f"| {r['rank']} | {_gb(r['start_peak_bytes'])} | {_gb(0.6 * model_fp32 + overhead)} | "
              f"{_gb(r['save_peak_bytes'])} | {_gb(0.6 * state)} | {r['save_seconds']:.1f} s |")
    ok = all(r["start_peak_bytes"] <= 0.6 * model_fp32 + overhead and r["save_peak_bytes"] <= 0.6 * state
             for r in big)
    print("within limits" if ok else "OVER THE LIMITS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
