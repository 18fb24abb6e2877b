#!/usr/bin/env bash
# One node, 8 GPUs: train, then verify the same grid against one device.
#     bash scripts/single_node.sh            # GPUS_PER_NODE=4 for a 4-GPU machine (change the grid)
# Grid: tp 2 (+SP) x pp 2 x dp 2 = 8 ranks, one per GPU (cuda:LOCAL_RANK).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
LAUNCH="torchrun --standalone --nproc-per-node $GPUS_PER_NODE"

run $LAUNCH -m minitron.train --tp 2 --sp --pp 2 --dp 2 $MODEL --steps 200 --batch 32 \
    --dtype bfloat16 --out runs/gpu_single_node --overwrite
run $LAUNCH -m minitron.verify --tp 2 --sp --pp 2 --dp 2 --schedule 1f1b --microbatches 4 \
    --hidden 256 --heads 8 --layers 4 --seq 64 --steps 3
