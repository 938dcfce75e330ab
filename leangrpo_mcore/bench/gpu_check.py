"""The one-GPU check: every GPU-only claim of the project measured in one run, written as one JSON.

  python -m leangrpo_mcore.bench.gpu_check --out DIR [--cpu]

Parts (each reports ``{"status": "ok" | "failed: ..." | "skipped: reason", ...}``; a missing dependency is a
skip, never a failure):

- ``diffusers_parity``: our FLUX policy (local megatron-core layers) against diffusers' ``FluxTransformer2DModel``
  on the same weights, in bf16 on CUDA (fp32 on CPU): relative L2 of the outputs.
- ``schedule_parity``: one step of Native, Retain and Reweight from identical weights; each gradient against
  Native's (cosine, relative L2), in bf16 on CUDA (fp32 on CPU).
- ``bench``: the three schedules on a FLUX.1-dev-shaped policy with fewer blocks
  (``yaml_configs/bench/flux_gpu.yaml``; on CPU the seconds-long ``smoke.yaml``): step time, phase breakdown,
  peak memory, ideal ratio.
- ``te_parity`` and ``fp8_agreement`` (when Transformer Engine imports): TE against local layers, and under
  FP8 (tensorwise) the fraction of Native's rollout-vs-recompute ratios clipped at 1e-4.

``--cpu`` runs the same code on the CPU with the small shapes, so the script itself is known to work before a
GPU is available (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
TINY_FLUX = {"family": "flux", "preset": "flux-tiny"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    img, txt = 16, 8
    ids = torch.stack([torch.zeros(img), torch.arange(img) // 4, torch.arange(img) % 4], dim=1)
    hyper = config.to_diffusers_config()
    out = dict(hidden_states=torch.randn(1, img, hyper["in_channels"], generator=gen),
               encoder_hidden_states=torch.randn(1, txt, hyper["joint_attention_dim"], generator=gen),
               pooled_projections=torch.randn(1, hyper["pooled_projection_dim"], generator=gen),
               timestep=torch.tensor([0.6]), img_ids=ids, txt_ids=torch.zeros(txt, 3))
    if hyper.get("guidance_embeds"):
        out["guidance"] = torch.tensor([3.5])
    return {k: v.to(device, dtype) if v.is_floating_point() and k not in ("img_ids", "txt_ids", "timestep",
                                                                           "guidance") else v.to(device)
            for k, v in out.items()}


def diffusers_parity(device: torch.device, dtype: torch.dtype) -> dict:
    """Our FLUX policy against diffusers' on the same weights."""
    from diffusers import FluxTransformer2DModel

    from leangrpo_mcore.models import build_policy, get_family, load_policy
    from leangrpo_mcore.models.common import checkpoint as ckpt

    ours = build_policy(TINY_FLUX, seed=0, backend="local")
    family = get_family("flux")
    with tempfile.TemporaryDirectory() as folder:
        tensors = family.mcore_to_diffusers({n: p.detach() for n, p in ours.named_parameters()}, ours.config)
        ckpt.write_diffusers_dir(folder, class_name=family.diffusers_class_name,
                                 config=ours.config.to_diffusers_config(), tensors=tensors)
        reference = FluxTransformer2DModel.from_pretrained(folder).to(device, dtype).eval()
        loaded = load_policy(folder, backend="local", dtype=dtype).to(device).eval()
    inputs = _inputs(loaded.config, device, dtype)
    with torch.no_grad():
        mine = loaded(**inputs)
        theirs = reference(**inputs, return_dict=False)[0]
    rel = _rel(mine, theirs)
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    return {"status": "ok" if rel <= limit else f"failed: relative L2 {rel:.3g} > {limit}", "rel_l2": rel,
            "limit": limit, "dtype": str(dtype).replace("torch.", "")}


def _bench(config_path: str, overrides: list[str], *, steps: int, warmup: int, parity: bool) -> dict:
    from leangrpo_mcore.bench.runner import BenchOptions, run_benchmark
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine.launch import init_distributed

    config = load_config(config_path, overrides)
    return run_benchmark(config, BenchOptions(steps=steps, warmup=warmup, check_parity=parity),
                         init_distributed())


def schedule_parity(cpu: bool) -> dict:
    """Each schedule's gradient against Native's from identical weights (one untimed step each)."""
    dtype = [] if cpu else ["model.dtype=bfloat16", "model.master_dtype=float32"]
    report = _bench(str(ROOT / "yaml_configs" / "bench" / "smoke.yaml"), ["logging.measure_memory=false", *dtype],
                    steps=1, warmup=0, parity=True)
    parity = report.get("parity") or {}
    cos_min, rel_max = (0.99999, 1e-3) if cpu else (0.999, 5e-2)
    bad = [name for name, p in parity.items() if name != "native" and
           not (p.get("cosine", 0) >= cos_min and p.get("rel_l2", math.inf) <= rel_max)]
    status = "ok" if parity and not bad else f"failed: {', '.join(bad) or 'no parity measured'}"
    return {"status": status, "parity": parity, "thresholds": {"cosine_min": cos_min, "rel_l2_max": rel_max}}


def bench(cpu: bool) -> dict:
    """The three schedules on the GPU bench policy (CPU: the smoke config)."""
    name = "smoke.yaml" if cpu else "flux_gpu.yaml"
    report = _bench(str(ROOT / "yaml_configs" / "bench" / name), [], steps=1 if cpu else 3, warmup=1, parity=False)
    return {"status": "ok", "config": f"yaml_configs/bench/{name}", "report": report}


def te_parity(device: torch.device) -> dict:
    """TE linears and attention against the local layers, same weights, bf16."""
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.models.backends import te_available

    if not te_available():
        return {"status": "skipped: Transformer Engine does not import or CUDA is unavailable"}
    local = build_policy(TINY_FLUX, seed=0, backend="local", dtype=torch.bfloat16).to(device)
    te_model = build_policy(TINY_FLUX, seed=0, backend="te", dtype=torch.bfloat16).to(device)
    inputs = _inputs(local.config, device, torch.bfloat16)
    with torch.no_grad():
        rel = _rel(te_model(**inputs), local(**inputs))
    return {"status": "ok" if rel <= 2e-2 else f"failed: relative L2 {rel:.3g} > 0.02", "rel_l2": rel}


def _native_clip_fraction(overrides: list[str]) -> float:
    """One Native step of the smoke config: the fraction of its rollout-vs-recompute ratios that were clipped."""
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.engine import build
    from leangrpo_mcore.engine.launch import init_distributed
    from leangrpo_mcore.engine.reward_bridge import RewardBridge
    from leangrpo_mcore.engine.step import StepInputs
    from leangrpo_mcore.parallel.mesh import destroy_parallel_context

    config = load_config(str(ROOT / "yaml_configs" / "bench" / "smoke.yaml"),
                         ["schedule.name=native", "grpo.clip_range=1e-4", *overrides])
    dist_ctx = init_distributed()
    pctx = build.build_context(config, dist_ctx)
    try:
        parts = build.build_policy_parts(config, pctx, build.precision_of(config, pctx))
        data = build.build_data_parts(config, parts.family, parts.policy.config.to_diffusers_config(),
                                      dist_ctx.device)
        bridge = RewardBridge(data, config)
        engine = build.build_engine(config, "native", parts, pctx, bridge)
        ids = data.sampler.next_indices()
        bridge.begin_step(False)
        result = engine.step(StepInputs(step=1, conditioning=data.text_encoder.encode(data.dataset.get(ids)),
                                        prompt_ids=torch.tensor(ids)))
        return sum(u.clip_fraction for u in result.updates) / len(result.updates)
    finally:
        destroy_parallel_context()


def fp8_agreement() -> dict:
    """Under FP8 (tensorwise), the fraction of Native's rollout-vs-recompute ratios outside a 1e-4 clip."""
    from leangrpo_mcore.models.backends import te_available

    if not te_available():
        dry = _native_clip_fraction([])  # the measurement itself, without FP8, so the script is known to work
        return {"status": "skipped: Transformer Engine does not import or CUDA is unavailable",
                "dry_run_clip_fraction_without_fp8": dry}
    clip = _native_clip_fraction(["model.backend=te", "model.fp8=tensorwise", "model.dtype=bfloat16"])
    return {"status": "ok" if clip <= 0.05 else f"failed: {clip:.1%} of the ratios clipped at 1e-4",
            "clip_fraction": clip}


def _run(name: str, part: Callable[[], dict]) -> dict:
    began = time.perf_counter()
    try:
        result = part()
    except ImportError as err:
        result = {"status": f"skipped: {err}"}
    except Exception as err:  # noqa: BLE001 -- one failing part must not hide the others
        lines = traceback.format_exception_only(type(err), err)
        result = {"status": f"failed: {lines[-1].strip()}"}
    result["seconds"] = round(time.perf_counter() - began, 2)
    print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run every part; exit 1 when a part failed (skips are not failures)."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU with the small shapes")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA device; use --cpu for the dry run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    parts = {
        "diffusers_parity": lambda: diffusers_parity(device, dtype),
        "schedule_parity": lambda: schedule_parity(args.cpu),
        "bench": lambda: bench(args.cpu),
        "te_parity": lambda: te_parity(device),
        "fp8_agreement": fp8_agreement,
    }
    results = {"device": torch.cuda.get_device_name(0) if not args.cpu else "cpu", "torch": torch.__version__,
               "parts": {name: _run(name, part) for name, part in parts.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [n for n, r in results["parts"].items() if r["status"].startswith("failed")]
    print(f"[gpu_check] wrote {out / 'gpu_check.json'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
