"""python -m minitron.bench overhead | overlap | kernels: measured side by side, printed as ratios.

overhead (overhead.py): what the parallel machinery costs when there is nothing to split.
overlap: at dp=2 on the CPU (gloo), the share of the gradient all-reduce time hidden behind
backward, from a measured timeline (overlap.py); with --tp 2, beside it, the share of sequence
parallelism's all-gather / reduce-scatter hidden behind the GEMMs by the chunked ring (tp_overlap.py).

kernels: the fused Triton kernels' benchmark (kernels.py), when it is installed.
"""
