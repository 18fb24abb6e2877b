"""A pipeline stage's auxiliary loss (the MoE routers' balance terms) carried into its backward.

A stage that is not the last has no loss of its own, but its routers' terms are terms of the
loss: the executor (executor.py) passes the stage's output through carry_aux_loss, so the
stage's backward also sends `scale` (the micro-batch's 1/m) down to its auxiliary loss.
"""
from __future__ import annotations

import torch


class _CarryAuxLoss(torch.autograd.Function):
    """forward: the stage's output as it is; backward: its gradient, and `scale` as the gradient
    of the auxiliary loss, which is a term of the loss (d loss / d aux = 1, times the 1/m of the
    micro-batch), so the routers of a stage that is not the last get their share."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


def carry_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    return _CarryAuxLoss.apply(out, aux, scale)
