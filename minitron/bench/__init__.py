"""python -m minitron.bench overhead | overlap | peers | kernels: measured side by side, printed as ratios.

overhead (overhead.py): what the parallel machinery costs when there is nothing to split.
overlap: at dp=2 on the CPU (gloo), the share of the gradient all-reduce time hidden behind
backward, from a measured timeline (overlap.py).
peers: minitron's DataParallel, ZeroStage3, 1F1B executor and tensor parallelism against torch's
DDP, FSDP2, pipelining and DTensor, measured side by side in one run (peers.py).
kernels: the fused Triton kernels' benchmark (kernels.py), when it is installed.
"""
