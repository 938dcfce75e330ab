#!/usr/bin/env bash
# The one-GPU check: every GPU-only claim of the project measured in one run, written as OUT_DIR/gpu_check.json.
#
#   tools/gpu_check.sh --out OUT_DIR [--wheels WHEEL_DIR] [--cpu]
#
# For a machine with nothing but a CUDA torch: WHEEL_DIR holds the other dependencies as wheels (about 13 MB per
# stack, well inside a 64 MiB bundle), built on any machine with network access from a working environment:
#
#   pip download --no-deps -d bundle $(pip freeze | grep -iE '^(megatron-core|diffusers|huggingface.hub|safetensors|einops|psutil|pyyaml|tqdm|httpx|httpcore|h11|anyio|sniffio|idna|certifi|regex|filelock|importlib.metadata|zipp)==')
#
# megatron-core's wheels are built per Python version (cp311 for today's stack, cp312 for the current one): run
# the command in each stack's environment into the same folder and one bundle serves both. The script takes the
# stack as given by the interpreter (PYTHON, default python3) and its torch: for each project in WHEEL_DIR, pip
# installs the newest wheel whose tags fit that interpreter, with --no-index --no-deps, into OUT_DIR/site; the
# package itself runs from this checkout.
# Parts (see leangrpo_mcore/bench/gpu_check.py): diffusers parity, the schedules' gradient parity, the schedule
# bench on a FLUX.1-dev-shaped policy, and with Transformer Engine its parity and FP8 rollout agreement. A part
# whose dependency is absent reports "skipped: reason". Typically well under 8 minutes on one GPU.
# --cpu runs everything on the CPU with small shapes (CI does, so the script is known to work before a GPU comes).
# Exit status: 0 all parts ok or skipped, 1 a part failed, 2 bad usage.
set -uo pipefail

OUT="" WHEELS="" CPU=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:-}; shift 2 ;;
    --wheels) WHEELS=${2:-}; shift 2 ;;
    --cpu) CPU="--cpu"; shift ;;
    *) echo "error: unknown argument $1 (usage: tools/gpu_check.sh --out DIR [--wheels DIR] [--cpu])" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "error: --out DIR is required" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "error: no wheels in $WHEELS" >&2; exit 2; }
  projects=$(ls "$WHEELS"/*.whl | sed 's#.*/##; s#-.*##' | sort -u)
  echo "[gpu_check] installing $(echo $projects | wc -w) projects from $WHEELS into $OUT/site for" \
       "$("$PY" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
    --find-links "$WHEELS" $projects || { echo "error: wheel install failed (no wheel fits this Python?)" >&2; exit 1; }
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$REPO"
"$PY" -m leangrpo_mcore.bench.gpu_check --out "$OUT" $CPU
