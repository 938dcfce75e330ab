"""Start-up work per rank at several world sizes: verifying a checkpoint on resume, and the seeded random init.

  python tools/bench_startup.py --workdir /tmp/leangrpo_startup --layers 2 --single-layers 2 --nproc 1 2

writes (once, with ``--save-nproc`` ranks under torchrun) a training checkpoint of a FLUX-architecture policy
with FLUX.1-dev's widths and the given block counts (2 + 2 blocks: 1.03 B parameters), full fine-tune with its
AdamW state (fp32 master weights, ``exp_avg``, ``exp_avg_sq``: about 12 GB), built from
``yaml_configs/tiny/flux.yaml`` with ``model.random_init``. Then, for each ``--nproc``, it launches that many
ranks, each of which times

- **verify**: the resume's check of the checkpoint against its ``COMPLETE`` marker
  (:func:`~leangrpo_mcore.engine.checkpoint.manifest.verify_on_ranks`: each rank reads and checksums its share of the
  bytes, one ``all_gather`` decides); the files were just written, so they are read from the page cache
  when the machine's memory holds them, which measures the checksums rather than the disk;
- **init**: filling its FSDP2 shards of the policy (built on ``meta``, sharded over the ranks, allocated) with
  the seeded init, box by box (:func:`~leangrpo_mcore.models.common.materialize.random_boxes`);
- with ``--full-draw``, the way the init worked before it drew boxes: each parameter's FULL tensor from a
  seeded ``torch.Generator``, on every rank whatever its share.

Each rank uses one thread (torchrun's ``OMP_NUM_THREADS=1``). Peak host memory: the save holds each rank's
share of weights and AdamW state (about 6 GB a rank at 2 ranks for 1 B parameters); the init holds the rank's
weights (4 GB at 1 rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "yaml_configs" / "tiny" / "flux.yaml")


def _overrides(preset: str, layers: int, single_layers: int, run_dir: str) -> list[str]:
    return [f"model.preset={preset}", f"model.arch.num_layers={layers}",
            f"model.arch.num_single_layers={single_layers}", "model.random_init=true", f"train.output_dir={run_dir}",
            "train.overwrite=true", "logging.progress_bar=false", "logging.tensorboard=false"]


def save_worker(preset: str, layers: int, single_layers: int, run_dir: str) -> None:
    """One rank: build the trainer (random init), give AdamW its state without a step, write checkpoint 1."""
    import torch

    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine.launch import get_logger, init_distributed
    from leangrpo_mcore.engine.trainer import Trainer

    dist_ctx = init_distributed()
    trainer = Trainer(load_config(CONFIG, _overrides(preset, layers, single_layers, run_dir)), dist_ctx,
                      get_logger(dist_ctx.rank))
    optimizer = trainer.parts.optimizer
    for group in optimizer.param_groups:
        for p in group["params"]:
            # The state AdamW's first step creates, without the gradients that step would need.
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    trainer._save(1)


def _time_init(preset: str, layers: int, single_layers: int, full_draw: bool) -> dict:
    import torch

    from leangrpo_mcore.models import get_family, resolve_model_config
    from leangrpo_mcore.models.common.materialize import fill, init_rules, random_boxes
    from leangrpo_mcore.models.common.tp import capture_tp_layout
    from leangrpo_mcore.models.registry import full_shapes, materialize, meta_policy
    from leangrpo_mcore.parallel.fsdp import apply_fsdp
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context

    family, config = resolve_model_config({"family": "flux", "preset": preset, "num_layers": layers,
                                           "num_single_layers": single_layers})
    model = meta_policy(get_family("flux"), config, "local", torch.float32)
    rules, shapes, layout = init_rules(model), full_shapes(model), capture_tp_layout(model)
    pctx = build_parallel_context(Layout(), "cpu")
    materialize(model, "cpu", seed=0, wrap=lambda m: apply_fsdp(m, pctx), layout=layout, fill_values=False)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    began = time.perf_counter()
    fill(model, layout, random_boxes(rules, shapes, seed=0))
    record = {"init_s": time.perf_counter() - began, "local_parameters": local,
              "parameters": sum(int(torch.Size(s).numel()) for s in shapes.values())}
    if full_draw:
        began = time.perf_counter()
        for name, shape in shapes.items():
            generator = torch.Generator().manual_seed(hash(name) % (2**31))
            torch.empty(shape).uniform_(-0.01, 0.01, generator=generator)
        record["full_draw_s"] = time.perf_counter() - began
    destroy_parallel_context()
    return record


def measure_worker(out: str, checkpoint: str, preset: str, layers: int, single_layers: int, full_draw: bool) -> None:
    """One rank: time the verification of ``checkpoint`` and the random init of its shards; write ``out``_<rank>."""
    import torch.distributed as dist

    from leangrpo_mcore.engine.checkpoint import manifest
    from leangrpo_mcore.engine.launch import init_distributed

    dist_ctx = init_distributed()
    files, problem = manifest.read_marker(checkpoint)
    if files is None:
        raise SystemExit(f"{checkpoint}: {problem}")
    dist.barrier()
    began = time.perf_counter()
    problem = manifest.verify_on_ranks(checkpoint)
    verify_s = time.perf_counter() - began
    share = sum(n for _, _, n in manifest.share_of(files, dist_ctx.rank, dist_ctx.world_size))
    dist.barrier()
    record = {"rank": dist_ctx.rank, "verify_s": verify_s, "verified": problem is None,
              "bytes_read": share, "checkpoint_bytes": sum(e["bytes"] for e in files.values()),
              **_time_init(preset, layers, single_layers, full_draw)}
    Path(f"{out}_{dist_ctx.rank}.json").write_text(json.dumps(record))


def _torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           *args]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})


def _report(rows: list[dict]) -> None:
    first = rows[0]
    print(f"FLUX architecture ({first['preset']} widths): {first['parameters'] / 1e9:.3f} B parameters; checkpoint "
          f"{first['checkpoint_bytes'] / 1e9:.2f} GB (weights + AdamW state)")
    print("| world size | rank | verify: bytes read | verify time | init: local parameters | init time |"
          + (" full draw (before) |" if "full_draw_s" in first else ""))
    print("|---|---|---|---|---|---|" + ("---|" if "full_draw_s" in first else ""))
    for r in rows:
        extra = f" {r['full_draw_s']:.2f} s |" if "full_draw_s" in r else ""
        print(f"| {r['world']} | {r['rank']} | {r['bytes_read'] / 1e9:.2f} GB | {r['verify_s']:.2f} s | "
              f"{r['local_parameters'] / 1e9:.3f} B | {r['init_s']:.2f} s |{extra}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/leangrpo_startup")
    parser.add_argument("--preset", default="flux-dev", help="FLUX preset giving the widths (flux-tiny: a smoke run)")
    parser.add_argument("--layers", type=int, default=2, help="FLUX double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=2, help="FLUX single-stream blocks")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="world sizes to measure")
    parser.add_argument("--save-nproc", type=int, default=2, help="world size that writes the checkpoint")
    parser.add_argument("--full-draw", action="store_true", help="also time drawing every FULL tensor per rank")
    parser.add_argument("--worker", choices=("save", "measure"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.workdir)
    run_dir = work / f"run_{args.preset}_{args.layers}x{args.single_layers}"
    checkpoint = run_dir / "checkpoints" / "step_1"
    if args.worker == "save":
        save_worker(args.preset, args.layers, args.single_layers, str(run_dir))
        return 0
    if args.worker == "measure":
        measure_worker(args.out, str(checkpoint), args.preset, args.layers, args.single_layers, args.full_draw)
        return 0
    common = ["--workdir", str(work), "--preset", args.preset, "--layers", str(args.layers), "--single-layers",
              str(args.single_layers)]
    if not (checkpoint / "COMPLETE").is_file():
        _torchrun(args.save_nproc, *common, "--worker", "save")
    rows = []
    for nproc in args.nproc:
        out = work / f"measure_ws{nproc}"
        _torchrun(nproc, *common, "--worker", "measure", "--out", str(out),
                  *(["--full-draw"] if args.full_draw else []))
        rows += [{"world": nproc, "preset": args.preset, **json.loads(Path(f"{out}_{r}.json").read_text())}
                 for r in range(nproc)]
    _report(rows)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
