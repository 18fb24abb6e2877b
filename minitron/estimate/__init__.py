"""Estimators: what a configuration costs, predicted from shapes alone (no ranks, no tensors).

activations.py  one layer's saved activation bytes per rank, term by term (Korthikanti et al.)
memory.py       one rank's memory in a training step by component (python -m minitron.memory)
flops.py        FLOPs of one iteration, tokens/s, MFU (python -m minitron.flops)
time_model.py   one step's time, term by term (compute, bubble, TP, PP, DP, ...)
published.py    published runs, and the time model's prediction for each
plan.py         every configuration that fits, ranked (python -m minitron.plan)
"""
