"""All-gather context parallelism: gather every rank's keys and values once, compute locally.

Megatron-Core's "all_gather" CP option. One all-gather of K and V over cp replaces the cp-1
ring steps: fewer, larger messages (better when latency dominates or s/cp is small), but
nothing overlaps with compute, and for a moment every rank holds the whole sequence's K, V.
Only this rank's K, V are saved for backward; backward gathers them again, computes every
block's share of dK, dV, and one reduce-scatter over cp sums the shares and hands each owner
its own (the all-gather's adjoint). Per rank, with B = 2 b h_kv s d elements (all of K, V):

    forward  all_gather      wire (cp-1)/cp * B * element size
    backward all_gather      wire (cp-1)/cp * B * element size
             reduce_scatter  wire (cp-1)/cp * B * 4 (the float32 shares)

The blocks and their exact merge are the ring's (blocks.py); only how K, V arrive differs.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.comm import Group
from .blocks import Accumulator, BlockMath
from .ring import RingSetup


def _gather_kv(k, v, group: Group) -> torch.Tensor:
    """[cp, 2, b, hkv, s/cp, d]: every rank's K and V, by cp rank."""
    kv = torch.stack([k, v]).contiguous()
    return comm.all_gather(kv, group, dim=0).reshape(group.size, *kv.shape)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: RingSetup):
        acc = Accumulator(q)
        kv_all = _gather_kv(k, v, setup.group)
        for src in range(setup.cp):
            setup.attend(acc, src, q, kv_all[src])
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)   # this rank's K, V only: 1/cp of the memory
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        setup = ctx.setup
        do = dout.contiguous()
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        kv_all = _gather_kv(k, v, setup.group)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        dkv_all = torch.zeros(kv_all.shape, dtype=lse.dtype, device=q.device)
        for src in range(setup.cp):
            setup.attend_backward(src, do, q, kv_all[src], out, lse, delta, dq, dkv_all[src])
        dkv = comm.reduce_scatter(dkv_all.flatten(0, 1), setup.group, dim=0)   # [2, ...] ours
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def allgather_attention(q, k, v, group: Group, causal: bool = True, layout: str = "zigzag",
                        scale: float | None = None, use_kernels: bool = False, drop=None):
    """Same contract as ring.ring_attention."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    setup = RingSetup(group, layout, causal, BlockMath(scale, use_kernels, drop))
    return AllGatherAttention.apply(q, k, v, setup)
