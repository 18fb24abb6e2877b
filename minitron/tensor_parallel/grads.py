"""The one gradient fix-up tensor parallelism needs before the optimizer step.

Under plain tensor parallelism every replicated parameter (norm weights, RowParallel biases,
learned positions) sees the full sequence on every rank, and the f/g operators make the
gradient reaching it identical everywhere: nothing to do.

Under sequence parallelism those same parameters are applied to this rank's s/tp tokens
only. Their gradient is a sum over tokens, so each rank holds the part of that sum for its
own tokens, and the true gradient is the sum over the tensor-parallel group:

    dL/dw = sum_tokens dL/dw|token = sum_r (sum over rank r's tokens)

Such parameters carry the attribute `sequence_parallel=True` (set by the layers and the
model). Megatron does the same in finalize_model_grads (_allreduce_layernorm_grads).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import comm
from ..runtime.comm import Group


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters marked `sequence_parallel=True`, in a fixed order (the same on every rank)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """Sum the gradients of sequence-parallel parameters over `group`, in place.

    The gradients are flattened into one buffer so the fix-up costs one all-reduce, not one
    per norm (many tiny messages would each pay the latency).
    """
    if group.size == 1:                  # nothing to sum (and no walk over the parameters)
        return
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
