"""python -m minitron.bench overhead | overlap | kernels | scaling: measured side by side, printed as ratios.

overhead (overhead.py): what the parallel machinery costs when there is nothing to split.
overlap: at dp=2 on the CPU (gloo), the share of the gradient all-reduce time hidden behind
backward, from a measured timeline (overlap.py).

kernels: the fused Triton kernels' benchmark (kernels.py), when it is installed.

scaling: weak and strong DP and TP scaling on 1-8 CPU ranks, scaling efficiency and MFU, beside
the planner's prediction for this CPU (scaling.py; results in bench/results/scaling.csv).
"""
