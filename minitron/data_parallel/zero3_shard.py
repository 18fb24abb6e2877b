"""One ZeRO-3 unit at run time: its persistent flat shard, and the full buffer gathered from it.

    _Unit               the shard, the gradient shard, gather / free / reduce_grads, and the
                        per-parameter counters that say when a micro-batch's gradients are in
    _FreeAfterBackward  an identity on a unit's input whose backward frees the unit's weights

zero3.py (ZeroStage3) builds one _Unit per unit (zero3_units.py) and hooks them into the model.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime import comm, comm_async
from .buffer import FlatLayout, flatten_into


class _FreeAfterBackward(torch.autograd.Function):
    """Identity on a unit's input; its backward, which runs once dL/d(input) is complete (every
    node of the unit that reads a weight has run), frees the unit's gathered weights."""

    @staticmethod
    def forward(ctx, unit, x):
        ctx.unit = unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.unit.free()
        return None, grad


class _Unit:
    """One module's parameters: a persistent 1/n shard and a full buffer that exists only
    while gathered (its storage is resized to 0 in between; the parameters stay views of it)."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], group, rank: int):
        n = group.size
        self.module, self.group, self.params = module, group, params
        self.layout = FlatLayout(params, None, pad_to=n)
        first = params[0]
        self.full = flatten_into(self.layout, first.dtype, first.device)
        size = self.layout.numel // n
        self.range = (rank * size, (rank + 1) * size)
        self.shard = self.full[self.range[0]:self.range[1]].clone()   # ZeroStage3 re-homes these
        self.grad_shard = torch.zeros_like(self.shard)
        self.gathered = True
        self.held = False     # a weight used twice (tied embedding): gathered until its reduce
        self.contributions = {p: 0 for p in params}   # gradients in this step, per parameter
        self.reduced = 0                                # micro-batches reduce-scattered so far
        # A group of one: the shard is the whole unit, so there is nothing to gather or free
        # (once ZeroStage3 has re-homed the shard, the parameters become views of it).
        self.sharded = n > 1
        self.free()

    def share_shard(self) -> None:
        """Unsharded (n = 1): make the shard the full buffer, the parameters views of it."""
        self.full = self.shard
        for p in self.params:
            p.data = self.layout.view(self.full, p)

    def contribute(self, p: nn.Parameter, scale: float) -> None:
        """One more gradient of p is in .grad; once every parameter has one more than has been
        reduce-scattered, the micro-batch is complete: send what .grad holds, free the weights."""
        self.contributions[p] += 1
        if min(self.contributions.values()) > self.reduced:
            self.reduce_grads(scale)
            self.reduced += 1
            self.free(force=True)

    def gather(self) -> None:
        if self.gathered or not self.sharded:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        comm_async.all_gather(self.shard, self.group, out=self.full, stamp=False).wait()
        self.gathered = True

    def free(self, force: bool = False) -> None:
        """Drop the gathered weights (a held unit only when its gradients are sent: `force`)."""
        if not self.sharded or (self.held and not force):
            return
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_grads(self, scale: float) -> None:
        """Reduce-scatter what .grad holds (times `scale`) into my gradient shard; free .grad."""
        data = torch.zeros(self.layout.numel, dtype=self.shard.dtype, device=self.shard.device)
        for p in self.params:
            if p.grad is not None:
                self.layout.view(data, p).copy_(p.grad)
            p.grad = None
        if scale != 1.0:                      # one replica: nothing to average, skip the pass
            data.mul_(scale)
        self.grad_shard.add_(comm.reduce_scatter(data, self.group))

    def reset(self) -> None:
        """A new step: no contributions, no .grad (the gradient shard is ZeroStage3's to zero)."""
        self.contributions = dict.fromkeys(self.contributions, 0)
        self.reduced = 0
        for p in self.params:
            p.grad = None
