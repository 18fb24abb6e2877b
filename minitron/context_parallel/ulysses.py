"""DeepSpeed-Ulysses: swap a sequence split for a head split, attend, swap back.

Before attention each rank holds all heads of its s/cp tokens; one all-to-all over cp gives
it h/cp heads of all s tokens, so attention runs as on one device (any kernel, no merging),
and a second all-to-all brings the output back to the sequence split (both are autograd
functions beside their siblings in tensor_parallel/mappings.py). Heads are independent,
so nothing is approximated; the price is that the query and kv head counts must divide by cp
(with tensor parallelism: heads/tp by cp), and every rank momentarily holds the whole
sequence for its heads. Per rank the all-to-alls move (cp-1)/cp of what they are given:

    forward   q, k, v in, out back:   (cp-1)/cp * b * (2 h_q + 2 h_kv) * (s/cp) * d * element size
    backward  the adjoints: the same bytes again

which, unlike the ring's K/V traffic, does not grow with cp: Ulysses wins when heads are
many and the network slow; the ring when heads are few (GQA) or cp exceeds the head count.
"""
from __future__ import annotations

import torch

from ..kernels import ops
from ..runtime.comm import Group
from ..tensor_parallel.mappings import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from .sharding import gathered_order


def check_heads(hq: int, hkv: int, cp: int) -> None:
    if hq % cp or hkv % cp:
        raise ValueError(f"Ulysses gives each of the cp={cp} ranks whole heads, but this rank has "
                         f"{hq} query and {hkv} key/value heads: use cp dividing both (with tp, "
                         "heads/tp), or the ring or all-gather variant")


def torch_attention(q, k, v, causal: bool, scale: float, drop=None) -> torch.Tensor:
    """softmax(q k^T * scale) v with autograd, GQA, optional causal mask and dropout weights."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if drop is not None:      # drop is keep/(1-p) in float32: one rounding per entry, as the reference's
        p = (p * drop).to(p.dtype)
    return p @ v


def ulysses_attention(q, k, v, group: Group, causal: bool = True, layout: str = "zigzag",
                      scale: float | None = None, use_kernels: bool = False, drop=None):
    """Same contract as ring.ring_attention; `drop` covers this rank's q heads (all cp ranks')."""
    cp = group.size
    check_heads(q.shape[1], k.shape[1], cp)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    order = gathered_order(q.shape[2] * cp, cp, layout, q.device)   # gathered index -> position
    back = torch.argsort(order)
    qf, kf, vf = (all_to_all_seq_to_heads(t, group).index_select(2, back) for t in (q, k, v))
    if drop is not None:                 # our heads after the swap: head group `rank`
        hc = q.shape[1] // cp
        drop = drop[:, group.rank * hc:(group.rank + 1) * hc]
    if use_kernels and drop is None:
        out = ops.flash_attention(qf, kf, vf, causal=causal, scale=scale)
    else:
        out = torch_attention(qf, kf, vf, causal, scale, drop)
    return all_to_all_heads_to_seq(out.index_select(2, order).contiguous(), group)
