"""python -m minitron.bench overhead | overlap | kernels | gpu: measured side by side, printed as ratios.

overhead (overhead.py): what the parallel machinery costs when there is nothing to split.
overlap: at dp=2 on the CPU (gloo), the share of the gradient all-reduce time hidden behind
backward, from a measured timeline (overlap.py).

kernels: the fused Triton kernels' benchmark (kernels.py), when it is installed.
gpu: everything that needs a GPU in one command, 8 minutes on one H200 (gpu.py; --dry-run).
"""
