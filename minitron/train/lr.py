"""The learning rate at each step: a linear warm-up, then a cosine decay (nanoGPT's, Megatron's).

    lr(step) = peak * (step + 1) / warmup                                  step < warmup
             = low + (peak - low) * (1 + cos(pi * t)) / 2,  t = (step - warmup) / (steps - warmup)

`low` is where the decay ends (min_lr, often peak / 10). Warm-up lets Adam's second moments
settle before full-size steps; the decay shrinks the steps as the loss flattens. With
schedule="constant" every step uses the peak.
"""
from __future__ import annotations

import math

LR_SCHEDULES = ("cosine", "constant")


def learning_rate(step: int, *, peak: float, steps: int, warmup: int = 0, min_lr: float = 0.0,
                  schedule: str = "cosine") -> float:
    """The learning rate of step `step` (0-based) of a `steps`-step run."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {LR_SCHEDULES}")
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or steps <= warmup:
        return peak
    t = min(1.0, (step - warmup) / (steps - warmup))
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def describe(*, peak: float, steps: int, warmup: int, min_lr: float, schedule: str) -> str:
    """One line for the run's header."""
    if schedule == "constant":
        head = f"lr {peak:g} constant"
    else:
        head = f"lr {peak:g}, cosine to {min_lr:g} at step {steps}"
    return head + (f", after {warmup} warm-up steps" if warmup else "")
