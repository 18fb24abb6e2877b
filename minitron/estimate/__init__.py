"""Estimators: what a configuration costs, predicted from shapes alone (no ranks, no tensors).

shape.py        a model's shape: ModelConfig plus today's MoE widths, the named modern presets
software.py     the software a run used, as a named set of features the planner keeps to
activations.py  one layer's saved activation bytes per rank, term by term (Korthikanti et al.)
memory.py       one rank's memory in a training step by component
flops.py        FLOPs of one iteration, tokens/s, MFU
time_model.py   one step's time, term by term (compute, bubble, TP, PP, DP, ...), summed from
  parallel.py       what it is given: the split (Parallel) and the cluster (Cluster)
  layer_time.py     one layer's compute, memory-bound kernels and TP/CP/EP collectives
  pipeline_time.py  the bubble and the stage-boundary sends
  optimizer_time.py the DP reduction, the gradient accumulation and the optimizer step
published.py    published runs, and the time model's prediction for each
plan.py         every configuration that fits, ranked

Their command lines, python -m minitron.estimate plan | memory | flops (cli.py dispatches):
plan_cli.py     the planner's ranking, or one configuration's step by term (--explain)
memory_cli.py   one rank's memory table
flops_cli.py    one iteration's FLOPs, and with --seconds its tokens/s, MFU and HFU
"""
