"""Hierarchical context parallelism: Ulysses inside groups of cp_a2a ranks, a ring across them.

Megatron-Core's "a2a+p2p" (hierarchical_context_parallel_sizes = [a, R], cp = a * R). The cp
ranks are cut into R groups of a neighbours (minitron/grid/subgroups.py: cp_rank = a2a_rank +
a * ring_rank). Inside a group, Ulysses' all-to-all (ulysses.py) swaps the sequence split for a
head split: each rank gets h/a heads of all the group's tokens (2a of the 2cp zigzag chunks,
put in increasing order). Across groups those longer, narrower blocks go around a ring
(ring.py), among the R ranks that hold the same heads: ring step t attends to the tokens of
the group ring_rank - t. Then the all-to-all swaps back. Per rank, with s_l = s/cp tokens held
and h_q, h_kv the (tensor-parallel rank's) heads:

    cp_a2a   forward  q, k, v in, out back   (a-1)/a * b * (2 h_q + 2 h_kv) * s_l * d * elem
             backward the adjoints           the same again
    cp_ring  forward  (R-1) blocks of 2 b (h_kv/a) (a s_l) d = 2 b h_kv s_l d elements
             backward (R-1) blocks again, and R-1 running dK, dV blocks, in the same dtype

So the ring's block is the flat ring's (a times longer, a times narrower) but only R-1 hops
of it: the all-to-all takes the fast links inside a node, the ring the slow ones across, with
R - 1 = cp/a - 1 hops instead of cp - 1. Heads must divide by a (not by cp, as Ulysses
needs), so it reaches a cp larger than the head count, where Ulysses alone cannot go.
"""
from __future__ import annotations

import torch

from ..runtime.comm import Group
from ..tensor_parallel.mappings import all_to_all_heads_to_seq, all_to_all_seq_to_heads
from .blocks import BlockMath
from .ring import RingAttention, RingSetup, ring_bytes
from .sharding import chunk_ids
from .ulysses import check_heads


def group_chunks(a2a: int, ring_rank: int, cp: int, layout: str) -> list[int]:
    """The chunks (of 2cp) the a2a group `ring_rank` holds after the all-to-all, in gathered
    order: member 0's two chunks, member 1's, ..."""
    return [c for j in range(a2a) for c in chunk_ids(cp, j + a2a * ring_rank, layout)]


def hierarchical_attention(q, k, v, groups: tuple[Group, Group], causal: bool = True,
                           layout: str = "zigzag", scale: float | None = None,
                           use_kernels: bool = False, drop=None):
    """Same contract as ring.ring_attention, over groups = (cp_a2a, cp_ring) of one cp group;
    `drop` covers this rank's q heads (every token), as Ulysses' does."""
    a2a, ring = groups
    a, cp = a2a.size, a2a.size * ring.size
    check_heads(q.shape[1], k.shape[1], a)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    c = q.shape[2] // 2                                   # tokens per chunk
    gathered = group_chunks(a, ring.rank, cp, layout)
    # tokens after the all-to-all, sorted by chunk: then a group's own block is one causal mask
    order = sorted(range(len(gathered)), key=gathered.__getitem__)
    perm = torch.cat([torch.arange(i * c, (i + 1) * c, device=q.device) for i in order])
    qf, kf, vf = (all_to_all_seq_to_heads(t, a2a).index_select(2, perm) for t in (q, k, v))
    if drop is not None:                                   # our heads after the swap: group `rank`
        hc = q.shape[1] // a
        drop = drop[:, a2a.rank * hc:(a2a.rank + 1) * hc]
    setup = RingSetup(ring, layout, causal, BlockMath(scale, use_kernels, drop),
                      chunks_of=lambda r: sorted(group_chunks(a, r, cp, layout)))
    out = RingAttention.apply(qf, kf, vf, setup)
    return all_to_all_heads_to_seq(out.index_select(2, torch.argsort(perm)).contiguous(), a2a)


def hierarchical_bytes(batch: int, q_heads: int, kv_heads: int, s: int, head_dim: int, a2a: int,
                       ring: int, element_size: int = 4) -> dict:
    """Wire bytes one rank sends per attention call, by sub-group (module docstring)."""
    s_local = s // (a2a * ring)
    swapped = (a2a - 1) * batch * (2 * q_heads + 2 * kv_heads) * s_local * head_dim * element_size // a2a
    around = ring_bytes(batch, kv_heads // a2a, s, head_dim, ring, element_size)
    return {"cp_a2a": {"forward": swapped, "backward": swapped}, "cp_ring": around}
