#!/usr/bin/env bash
# Train on several machines with torchrun's static rendezvous. Run the same command on every node:
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<host of node 0> MASTER_PORT=29500 NPROC_PER_NODE=8 \
#     examples/train_multi_node.sh yaml_configs/flux_dev/dancegrpo.yaml
#
# Required: NNODES, NODE_RANK, MASTER_ADDR. Optional: MASTER_PORT (29500), NPROC_PER_NODE (visible GPUs).
# train.output_dir must be on a filesystem every node sees (checkpoints are written by all ranks).
set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: $0 CONFIG.yaml [dotted.key=value ...]" >&2
  exit 2
fi
for var in NNODES NODE_RANK MASTER_ADDR; do
  if [ -z "${!var:-}" ]; then
    echo "error: $var is not set (see the header of $0)" >&2
    exit 2
  fi
done
config="$1"
shift
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

exec leangrpo-torchrun \
  --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${NPROC_PER_NODE}" \
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
  -m leangrpo_mcore.train --config "${config}" "$@"
