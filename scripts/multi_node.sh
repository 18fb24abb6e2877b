#!/usr/bin/env bash
# Several nodes of 8 GPUs: run this same command on every node (any order; they meet at the
# rendezvous, which assigns the node ranks).
#     RDZV_HOST=node0 NNODES=2 bash scripts/multi_node.sh
# RDZV_HOST: a node every node can reach (its c10d store listens on RDZV_PORT).
# Grid for 2 x 8 GPUs: tp 8 (+SP) inside each node, pp 2 across the nodes (lesson 12: TP's
# all-reduces stay on NVLink, PP's one message per micro-batch crosses the network).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
: "${RDZV_HOST:?set RDZV_HOST to a node every node can reach}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
RDZV_ID=${RDZV_ID:-minitron}
LAUNCH="torchrun --nnodes $NNODES --nproc-per-node $GPUS_PER_NODE --rdzv-backend c10d \
--rdzv-endpoint $RDZV_HOST:$RDZV_PORT --rdzv-id $RDZV_ID --max-restarts 0"

run $LAUNCH -m minitron.train --tp 8 --sp --pp 2 $MODEL --steps 200 --batch 32 \
    --dtype bfloat16 --out runs/gpu_multi_node --overwrite
run $LAUNCH -m minitron.verify --tp 8 --sp --pp 2 --schedule 1f1b --microbatches 4 \
    --hidden 256 --heads 8 --layers 4 --seq 64 --steps 3
