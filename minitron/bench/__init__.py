"""python -m minitron.bench overhead | overlap | peers | kernels | precision | scaling | gpu |
dualpipev: measured side by side.

overhead (overhead.py): what the parallel machinery costs when there is nothing to split.
overlap: at dp=2 on the CPU (gloo), the share of the gradient all-reduce time hidden behind
backward, from a measured timeline (overlap.py); with --tp 2, beside it, the share of sequence
parallelism's all-gather / reduce-scatter hidden behind the GEMMs by the chunked ring (tp_overlap.py).
dualpipev: DualPipeV on pp x ep CPU ranks with and without its (F, BW) pairs overlapped, the share
of the MoE all-to-all hidden from a measured timeline, the step ratio, and the simulator's
timeline beside the measured ones (dualpipev.py).
peers: minitron's DataParallel, ZeroStage3, 1F1B executor and tensor parallelism against torch's
DDP, FSDP2, pipelining and DTensor, measured side by side in one run (peers.py; each pair is
built in peer_pairs.py).

kernels: the fused Triton kernels' benchmark (kernels.py), when it is installed.

precision: one short training run in float32, bf16 and FP8, loss curves and gaps (precision.py).
scaling: weak and strong DP and TP scaling on 1-8 CPU ranks, scaling efficiency and MFU, beside
the planner's prediction for this CPU (scaling.py; results in bench/results/scaling.csv).
gpu: everything that needs a GPU in one command, 8 minutes on one H200 (gpu.py; --dry-run).
"""
