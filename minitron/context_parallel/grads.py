"""The gradient fix-up context parallelism needs before the optimizer step (without DP).

Each cp rank holds every weight whole but sees only its s/cp tokens, and its loss is the mean
over those tokens. The reference's loss is the mean of the cp ranks' losses, so its gradient
is the mean of theirs: every gradient is summed over cp and divided by cp. (Gradients reach a
rank's weights from other ranks' losses too, through the keys and values they borrowed; the
sum collects those.) With data parallelism, DataParallel averages over dense_dp, which
contains cp: then this is already done and must not be repeated.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import comm
from ..runtime.comm import Group


def average_grads_over_cp(module: nn.Module, group: Group) -> None:
    """Average every gradient over the cp group in place, in one all-reduce."""
    if group.size == 1:                  # nothing to average (and no walk over the parameters)
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    flat.div_(group.size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
