#!/usr/bin/env bash
# The CPU benchmark runs recorded in BENCHMARKS.md, one after the other (about an hour on 2 cores).
#
#   . .venv/bin/activate && tools/cpu_bench.sh [OUT_DIR [NAME ...]]   (default runs/bench/cpu; an idle machine)
#
# With NAMEs only those runs (e.g. tools/cpu_bench.sh runs/bench/cpu flux_flowgrpo_ws2 qwen_image_flowgrpo_ws1).
# Every run writes OUT_DIR/NAME.{json,md,png} and its log OUT_DIR/NAME.log. World size 1 runs one process with
# one thread; world size 2 runs two gloo ranks of one thread each, so a rank computes alike in both.
set -euo pipefail
command -v torchrun >/dev/null || { echo "cpu_bench: torchrun not found: activate the environment that has the package" >&2; exit 2; }

OUT=${1:-runs/bench/cpu}
ONLY=" ${*:2} "
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

wanted() { [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $1 "* ]]; }
one()  { local name=$1; shift; wanted "$name" || return 0; echo "== $name (world size 1)"
         OMP_NUM_THREADS=1 python -m leangrpo_mcore.cli.bench "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
           --plot "$OUT/$name.png" > "$OUT/$name.log" 2>&1; }
two()  { local name=$1; shift; wanted "$name" || return 0; echo "== $name (world size 2)"
         OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m leangrpo_mcore.cli.bench "$@" \
           --json "$OUT/$name.json" --markdown "$OUT/$name.md" --plot "$OUT/$name.png" > "$OUT/$name.log" 2>&1; }

B=yaml_configs/bench
ALL=native,native_coalesced,retain,reweight
two flux_flowgrpo_ws2      --config $B/flux_flowgrpo.yaml      --schedules $ALL --steps 7 --warmup 1 --check-parity
one flux_flowgrpo_ws1      --config $B/flux_flowgrpo.yaml      --steps 7 --warmup 1
# the auto layout (the plain label) against Reweight on each data-parallel layout and each FSDP2 gathering
two layout_sweep_ws2       --config $B/flux_flowgrpo.yaml      --schedules reweight,reweight@sharded,reweight@replicated \
                           --no-baselines --steps 5 --warmup 1 --sweep parallel.reshard_after_forward=auto,true,rollout,false
two flux_flowgrpo_lora_ws2 --config $B/flux_flowgrpo_lora.yaml --schedules $ALL --steps 5 --warmup 1
one flux_flowgrpo_lora_ws1 --config $B/flux_flowgrpo_lora.yaml --steps 5 --warmup 1
two wan_dancegrpo_ws2      --config $B/wan_dancegrpo.yaml      --schedules $ALL --steps 5 --warmup 1 --check-parity
# every schedule with the parameters kept gathered (Reweight keeps them gathered under DanceGRPO selection anyway)
two wan_dancegrpo_gathered_ws2 --config $B/wan_dancegrpo.yaml  --schedules $ALL --steps 5 --warmup 1 \
                           parallel.reshard_after_forward=false
one wan_dancegrpo_ws1      --config $B/wan_dancegrpo.yaml      --steps 5 --warmup 1
two wan_dancegrpo_all_steps_ws2 --config $B/wan_dancegrpo_all_steps.yaml --schedules $ALL --steps 3 --warmup 1
one wan_dancegrpo_all_steps_ws1 --config $B/wan_dancegrpo_all_steps.yaml --steps 3 --warmup 1
two wan_dancegrpo_lora_ws2 --config $B/wan_dancegrpo_lora.yaml --schedules $ALL --steps 3 --warmup 1
two sweep_selected_ws2     --config $B/flux_sweep.yaml --steps 3 --warmup 1 \
                           --sweep grpo.timestep_fraction=0.17,0.34,0.5,0.67,0.99
one sweep_selected_ws1     --config $B/flux_sweep.yaml --steps 3 --warmup 1 \
                           --sweep grpo.timestep_fraction=0.17,0.34,0.5,0.67,0.99
two sweep_tokens_ws2       --config $B/flux_sweep.yaml --steps 3 --warmup 1 --sweep sampler.height=128,256,512
two sd3_flowgrpo_ws2       --config $B/sd3_flowgrpo.yaml       --schedules $ALL --steps 3 --warmup 1 --check-parity
# two experts of the Wan shape (Wan2.2-A14B's routing); Native coalesces, so native_coalesced is its one Native
two wan_a14b_dancegrpo_ws2 --config $B/wan_a14b_dancegrpo.yaml --schedules native,retain,reweight --steps 3 --warmup 1 \
                           --check-parity
one sd3_flowgrpo_ws1       --config $B/sd3_flowgrpo.yaml       --steps 3 --warmup 1
two qwen_image_flowgrpo_ws2 --config $B/qwen_image_flowgrpo.yaml --schedules $ALL --steps 3 --warmup 1 --check-parity
one qwen_image_flowgrpo_ws1 --config $B/qwen_image_flowgrpo.yaml --steps 3 --warmup 1
# FLUX.1-Kontext editing: the source image's tokens beside the generated ones (the demo dataset, read by DALI)
if wanted kontext_flowgrpo_ws2 && [ ! -f runs/edit_demo/data/train_metadata.jsonl ]; then
  python tools/make_edit_demo.py runs/edit_demo > /dev/null
fi
two kontext_flowgrpo_ws2   --config $B/flux_kontext.yaml       --schedules $ALL --steps 5 --warmup 1 --check-parity
# MixGRPO-Flash's sampler (T' = 11 of 25 steps at the window's first position, |S| = 4) and K = 2 updates per rollout
two flux_mixgrpo_flash_ws2 --config $B/flux_mixgrpo_flash.yaml --schedules $ALL --steps 5 --warmup 1 --check-parity
two flux_flowgrpo_k2_ws2   --config $B/flux_flowgrpo.yaml      --schedules $ALL --steps 5 --warmup 1 --check-parity \
                           grpo.updates_per_rollout=2 grpo.prompts_per_step=2
echo "done: $OUT"
