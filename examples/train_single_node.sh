#!/usr/bin/env bash
# Train on the GPUs (or CPU cores) of one machine.
#
#   NPROC_PER_NODE=8 examples/train_single_node.sh yaml_configs/flux_dev/flowgrpo_lora.yaml train.max_steps=100
#
# Environment: NPROC_PER_NODE (default: the number of visible GPUs, or 2 on a CPU-only machine).
# Everything after the config path is passed on as dotted.key=value overrides.
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 CONFIG.yaml [dotted.key=value ...]" >&2
  exit 2
fi
config="$1"
shift

if [ -z "${NPROC_PER_NODE:-}" ]; then
  gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "${gpus}" -gt 0 ]; then NPROC_PER_NODE="${gpus}"; else NPROC_PER_NODE=2; fi
fi

exec leangrpo-torchrun --standalone --nproc-per-node "${NPROC_PER_NODE}" \
  -m leangrpo_mcore.train --config "${config}" "$@"
