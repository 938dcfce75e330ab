#!/usr/bin/env bash
# One prepared GPU check of the schedules, for a GPU machine without network access.
#
#   tools/gpu_bench.sh WHEEL_DIR [OUT_DIR]
#   QWEN_IMAGE_GPUS=4 tools/gpu_bench.sh WHEEL_DIR [OUT_DIR]      (step 4 on 4 GPUs; 0 skips it)
#
# WHEEL_DIR holds the wheels of everything the machine lacks (not torch: the machine's CUDA torch is used), e.g.
# megatron_core, diffusers, huggingface_hub, safetensors, einops, psutil, pyyaml, pillow, numpy, regex, requests,
# filelock, importlib_metadata, tqdm and their own dependencies (see BENCHMARKS.md, "GPU"). They are installed with
# --no-index --no-deps into OUT_DIR/site; the package itself is used from this checkout (PYTHONPATH).
#
# Steps, each writing into OUT_DIR (default gpu_bench_out):
#   1. environment: nvidia-smi, torch/CUDA versions                              -> env.txt
#   2. correctness on CUDA: one rollout per schedule from identical weights, each gradient against Native's,
#      in float32 and in bfloat16 (the FlowGRPO FLUX bench shape)              -> parity_fp32.json, parity_bf16.json
#      thresholds: cosine >= 0.99999 and rel. L2 <= 1e-3 (fp32); cosine >= 0.999 and rel. L2 <= 5e-2 (bf16)
#   3. the benchmark on a larger FLUX-shaped policy (yaml_configs/bench/flux_gpu.yaml, 1.3 B parameters,
#      1024 tokens, bf16)                                                       -> flux_gpu.{json,md,png}
#   4. Qwen-Image at full size (yaml_configs/bench/qwen_image_gpu.yaml: 20.4 B, verl-omni's FlowGRPO-OCR rollout
#      at 512 px) on QWEN_IMAGE_GPUS ranks (default: every GPU), LoRA r=64 and, from 4 GPUs on, the non-CFG full
#      fine-tune; each schedule's images per second per GPU beside verl-omni's published 0.305 (LoRA, 4 x H800)
#      and 0.51 (full, 4 x H200)                                                 -> qwen_image_{lora,full}.{json,md}
# Exit status: non-zero when a step fails or a parity threshold is missed (the later steps still run).
set -uo pipefail

WHEELS=${1:?usage: tools/gpu_bench.sh WHEEL_DIR [OUT_DIR]}
OUT=${2:-gpu_bench_out}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
status=0

log() { echo "[gpu_bench] $*" | tee -a "$OUT/log.txt"; }

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  log "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $OUT/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
    "$WHEELS"/*.whl || { log "wheel install failed"; exit 1; }
else
  log "no wheels in $WHEELS: using the packages already installed"
fi
export PYTHONPATH="$OUT/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"

{ nvidia-smi || true; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { log "no CUDA device"; exit 1; }
"$PY" -c "import megatron.core, diffusers, leangrpo_mcore.bench" 2>>"$OUT/log.txt" \
  || { log "imports failed (missing wheels?), see log.txt"; exit 1; }

bench() { "$PY" -m leangrpo_mcore.cli.bench "$@" 2>>"$OUT/log.txt"; }

check_parity() {  # check_parity FILE MIN_COSINE MAX_REL_L2
  "$PY" - "$@" <<'EOF'
import json, math, sys
path, min_cos, max_rel = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
bad = []
for run in json.load(open(path))["runs"]:
    for name, row in run["parity"].items():
        ok = math.isfinite(row["cosine"]) and row["cosine"] >= min_cos and row["rel_l2"] <= max_rel
        print(f"{path}: {name}: cosine {row['cosine']:.6f} rel_l2 {row['rel_l2']:.2e} "
              f"reward diff {row['reward_max_abs_diff']:.2e} {'ok' if ok else 'FAILED'}")
        bad += [] if ok else [name]
sys.exit(1 if bad else 0)
EOF
}

PARITY=(--config yaml_configs/bench/flux_flowgrpo.yaml --schedules native,native_coalesced,retain,reweight
        --steps 1 --warmup 1 --check-parity)
log "parity in float32"
bench "${PARITY[@]}" --json "$OUT/parity_fp32.json" --markdown "$OUT/parity_fp32.md" model.dtype=float32 \
  && check_parity "$OUT/parity_fp32.json" 0.99999 1e-3 | tee -a "$OUT/log.txt" || status=1
log "parity in bfloat16"
bench "${PARITY[@]}" --json "$OUT/parity_bf16.json" --markdown "$OUT/parity_bf16.md" model.dtype=bfloat16 \
  && check_parity "$OUT/parity_bf16.json" 0.999 5e-2 | tee -a "$OUT/log.txt" || status=1

log "benchmark: larger FLUX-shaped policy"
bench --config yaml_configs/bench/flux_gpu.yaml --schedules native,native_coalesced,retain,reweight \
  --steps 3 --warmup 1 --json "$OUT/flux_gpu.json" --markdown "$OUT/flux_gpu.md" --plot "$OUT/flux_gpu.png" \
  || { log "benchmark failed, see log.txt"; status=1; }
[ -f "$OUT/flux_gpu.md" ] && cat "$OUT/flux_gpu.md"

images_per_gpu() {  # images_per_gpu FILE PUBLISHED
  "$PY" - "$@" <<'EOF'
import json, sys
path, published = sys.argv[1], float(sys.argv[2])
for name, entry in json.load(open(path))["runs"][0]["schedules"].items():
    rate = (entry.get("throughput") or {}).get("samples_per_s_per_device")
    print(f"{path}: {name}: {rate:.3f} images/GPU/s (verl-omni published {published})" if rate is not None
          else f"{path}: {name}: no throughput")
EOF
}

GPUS=${QWEN_IMAGE_GPUS:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
QWEN=(--config yaml_configs/bench/qwen_image_gpu.yaml --schedules native,retain,reweight --steps 2 --warmup 1)
qwen_bench() {  # qwen_bench NAME OVERRIDES...
  local name=$1; shift
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m leangrpo_mcore.cli.bench "${QWEN[@]}" \
    --json "$OUT/$name.json" --markdown "$OUT/$name.md" "$@" 2>>"$OUT/log.txt"
}
if [ "$GPUS" -ge 1 ]; then
  log "benchmark: Qwen-Image LoRA on $GPUS GPU(s)"
  qwen_bench qwen_image_lora && images_per_gpu "$OUT/qwen_image_lora.json" 0.305 | tee -a "$OUT/log.txt" \
    || { log "Qwen-Image LoRA benchmark failed, see log.txt"; status=1; }
fi
if [ "$GPUS" -ge 4 ]; then  # 20.4 B parameters with fp32 masters and AdamW state: 327 GB over the ranks
  log "benchmark: Qwen-Image full fine-tune on $GPUS GPUs"
  qwen_bench qwen_image_full model.lora.rank=0 sampler.cfg_scale=1 optim.lr=3e-5 grpo.clip_range=1e-5 \
    && images_per_gpu "$OUT/qwen_image_full.json" 0.51 | tee -a "$OUT/log.txt" \
    || { log "Qwen-Image full fine-tune benchmark failed, see log.txt"; status=1; }
fi
log "done (status $status): $OUT"

exit $status
