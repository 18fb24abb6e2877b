"""Ring attention: keys and values travel around the cp ring; queries stay home.

Each of the cp ranks holds s/cp tokens (sharding.py: two chunks). At step t rank r holds
the key/value block of rank (r - t) mod cp: it posts the send of that block to rank r+1 and
the receive of the next one from rank r-1, computes its queries against the block it has
while the messages fly, merges the partial result exactly (blocks.Accumulator), then waits.
After cp steps every query has seen every key, and each rank sent cp-1 blocks:

    forward bytes per rank = (cp - 1) * 2 * b * h_kv * (s/cp) * d * element size

Backward sends the same blocks around once more, and with them the gradients dK, dV of the
block's owner, Megatron-Core's way (AttnFuncWithCPAndKVP2P): the owner keeps its own share at
home; at step t >= 1 a rank adds its share for the block it holds (rank r-t's) to the running
dK, dV that arrived from rank r-1 (the shares of ranks r-t+1 .. r-1) and passes them on, so the
sum of every other rank's share reaches the owner after cp-1 hops and is added to its own. dQ
never moves: every block's share of it is computed where the queries live. The running dK, dV
travel in the activations' dtype, as K and V do (each hop of a 16-bit run rounds the sum once):

    backward bytes per rank = (cp - 1) * 2 * b * h_kv * (s/cp) * d * element size   (K, V)
                            + (cp - 1) * 2 * b * h_kv * (s/cp) * d * element size   (dK, dV)

The messages go through comm_async.exchange (comm.exchange without the wait, counted the same
way by minitron.runtime.comm), so tests compare the bytes with these formulas.
"""
from __future__ import annotations

import torch

from ..runtime import comm_async
from ..runtime.comm import P2P, Group
from .blocks import Accumulator, BlockMath, block_pairs
from .sharding import chunk_ids


class RingSetup:
    """What the autograd function needs besides tensors (one per call).

    chunks_of(r): the sequence chunks ring rank r holds, in its local order (default: its two
    of sharding.chunk_ids; the hierarchical variant's ring ranks hold a group's 2*cp_a2a)."""

    def __init__(self, group: Group, layout: str, causal: bool, math: BlockMath, chunks_of=None):
        self.group, self.layout, self.causal, self.math = group, layout, causal, math
        self.cp, self.rank = group.size, group.rank
        self.next, self.prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        self.chunks_of = chunks_of or (lambda r: chunk_ids(self.cp, r, layout))

    def blocks(self, src: int, s_local: int, device):
        """Every (rows, cols, causal, q positions, k positions) this rank computes against
        the key/value block of ring rank `src`."""
        mine, theirs = self.chunks_of(self.rank), self.chunks_of(src)
        c = s_local // len(mine)
        q_pos, k_pos = chunk_positions(mine, c, device), chunk_positions(theirs, c, device)
        return [(rows, cols, diag, q_pos[rows], k_pos[cols])
                for rows, cols, diag in block_pairs(mine, theirs, c, self.causal)]

    def attend(self, acc: Accumulator, src: int, q, kv) -> None:
        """Merge into `acc` this rank's queries' attention over ring rank src's keys and
        values, kv = [2, b, hkv, s/cp, d], block by block."""
        for rows, cols, diag, qp, kp in self.blocks(src, q.shape[2], q.device):
            out_b, lse_b = self.math.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                             diag, qp, kp)
            acc.merge(rows, out_b, lse_b)

    def attend_backward(self, src: int, do, q, kv, out, lse, delta, dq, dkv) -> None:
        """attend's backward: adds this rank's share into dq and src's block's into dkv [2, ...]."""
        for rows, cols, diag, qp, kp in self.blocks(src, q.shape[2], q.device):
            dq_b, dk_b, dv_b = self.math.backward(
                do[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows], delta[:, :, rows], diag, qp, kp)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b


def chunk_positions(chunks, c: int, device) -> torch.Tensor:
    """Global positions of chunks (c tokens each) end to end (sharding.positions' arithmetic)."""
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: RingSetup):
        cp = setup.cp
        acc = Accumulator(q)
        kv, kv_next = torch.stack([k, v]).contiguous(), None
        for step in range(cp):
            src = (setup.rank - step) % cp
            posted = None
            if step < cp - 1:              # the next block is on its way while we compute
                kv_next = torch.empty_like(kv)
                posted = comm_async.exchange([P2P("send", kv, setup.next),
                                              P2P("recv", kv_next, setup.prev)], setup.group)
            setup.attend(acc, src, q, kv)
            if posted is not None:
                posted.wait()
                kv = kv_next
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        setup = ctx.setup
        cp, group = setup.cp, setup.group
        do = dout.contiguous()
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1)   # rowsum(dO * O), global
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        own = None        # this rank's share of its own block's dK, dV: it never leaves
        dkv = None        # the running dK, dV of the block we hold (its owner's, on its way home)
        for step in range(cp):
            src = (setup.rank - step) % cp
            ops, kv_next, dkv_in = [], None, None
            if step < cp - 1:
                kv_next = torch.empty_like(kv)
                ops += [P2P("send", kv, setup.next), P2P("recv", kv_next, setup.prev)]
            if step > 1:   # pass on last step's running sum; receive the one for this block
                dkv_in = torch.empty_like(dkv)
                ops += [P2P("send", dkv, setup.next), P2P("recv", dkv_in, setup.prev)]
            posted = comm_async.exchange(ops, group) if ops else None
            share = torch.zeros((2, *k.shape), dtype=lse.dtype, device=k.device)
            setup.attend_backward(src, do, q, kv, out, lse, delta, dq, share)
            if posted is not None:
                posted.wait()
            if step == 0:
                own = share
            else:          # sent on in the activations' dtype, as K and V are
                dkv = (share if dkv_in is None else dkv_in.to(lse.dtype) + share).to(k.dtype)
            if kv_next is not None:
                kv = kv_next
        if cp > 1:        # the last hop: the other ranks' shares arrive home
            home = torch.empty_like(dkv)
            ops = [P2P("send", dkv, setup.next), P2P("recv", home, setup.prev)]
            comm_async.exchange(ops, group).wait()
            own = own + home.to(lse.dtype)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


def ring_attention(q, k, v, group: Group, causal: bool = True, layout: str = "zigzag",
                   scale: float | None = None, use_kernels: bool = False, drop=None):
    """Attention of this rank's queries q [b, hq, s/cp, d] over the whole sequence's keys,
    k/v [b, hkv, s/cp, d] being this rank's; tokens in sharding.positions order."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    setup = RingSetup(group, layout, causal, BlockMath(scale, use_kernels, drop))
    return RingAttention.apply(q, k, v, setup)


def ring_bytes(batch: int, kv_heads: int, s: int, head_dim: int, cp: int,
               element_size: int = 4) -> dict[str, int]:
    """The bytes one rank sends through the ring per attention call (see the docstring): K, V
    and, backward, the running dK, dV, each cp - 1 blocks in the activations' dtype."""
    block = 2 * batch * kv_heads * (s // cp) * head_dim
    return {"forward": (cp - 1) * block * element_size,
            "backward": 2 * (cp - 1) * block * element_size}
