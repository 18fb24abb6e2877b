"""The float32 bars the verifier holds a split to: sums (logits, loss, dL/dX, gradients) and
the optimizer's update (float32_rows.py compares against them).

Tolerances for logits, loss, dL/dX and gradients (see `float32_tolerance`): both sides compute
the same sums in float32, in different orders (a split reduction, a different kernel), so each
result differs from the exact one by rounding. For a sum of K terms the rounding error grows
like sqrt(K) * eps32 relative to the terms (a random walk of K roundings, eps32 = 2^-23); the
longest sum in the model, K = max(hidden, ffn, vocab, seq, batch*seq), sets the bar, and a
constant C covers the chain of such sums (layers, forward then backward) and the errors of
both sides:

    tol = C * sqrt(K) * eps32,   C = 4            (default model: K = 256, tol = 7.6e-6)

C is measured, not guessed (tests/test_verify.py). In units of sqrt(K) * eps32, the float32
reference's own error against a float64 reference of the same weights is at most 0.45 on
the shapes tried, and so does a correct split's error against the float32 reference (tp 1 to
8, SP, GQA, RMSNorm/SwiGLU/RoPE, dropout, the fused kernels): a split is as accurate as one
device. C = 4 leaves a margin of about 9 over that (tests/test_verify.py asserts at least 4),
while a 1% error anywhere is 1000 times over. The loss is computed in float32 on both sides whatever the dtype, so float64 runs are
held to the same bar.

The optimizer step is checked at its own scale. Adam moves a weight by about lr * sign(g)
however small |g| is, so an entry of g that is rounding noise (the key bias's gradient is
zero in exact arithmetic) would turn two slightly different gradients into two full, opposite
steps. So both optimizers are driven by the same gradients, the reference's (each rank gets
its shards of them); the gradients themselves are compared separately, above. Then the update
u = w_new - w_old of every tensor is compared with the reference's update, relative to the
largest entry of that update, after allowing each entry the float32 spacing of the stored
weight (2 ulp: w_new is rounded once on each side; an update is only as precise as the weight
that holds it). AdamW is elementwise, so what remains is a few roundings of the step itself:

    update tol = 16 * eps32 = 1.9e-6     (measured: 0 with torch's eager AdamW, <= 0.3 eps32 with its
                                          fused CPU kernel, ZeroOptimizer's on CPU; <= 1.1 eps32 with
                                          the Triton kernel)

A 1% error in one tensor's update is then 5000 times over (a norm weight of 1.0 moved by
lr = 1e-4 is resolved only to 2.4e-7 of its 1e-4 update: still caught, at 7.6e-3).
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig

EPS32 = torch.finfo(torch.float32).eps
C_SUM = 4          # tol = C_SUM * sqrt(K) * eps32 for logits, loss, dL/dX, gradients
C_UPDATE = 16      # update tol = C_UPDATE * eps32, beyond the weight's own spacing
ULP_SLACK = 2      # spacings of the stored weight allowed per entry of an update
FLOOR = 1e-3       # a tensor with no scale of its own is measured against this much of the largest


def longest_sum(cfg: ModelConfig, batch: int, seq: int) -> int:
    """K: the most terms any one number of the step is a sum of."""
    return max(cfg.hidden, cfg.ffn, cfg.vocab_size, seq, batch * seq)


def float32_tolerance(cfg: ModelConfig, batch: int, seq: int) -> float:
    return C_SUM * math.sqrt(longest_sum(cfg, batch, seq)) * EPS32


def update_tolerance() -> float:
    return C_UPDATE * EPS32
