"""Context parallelism: every layer's sequence split over the cp group (lesson 09).

Sequence parallelism splits only the norm and dropout regions; attention still needs every
token's keys and values, and its activations grow as s^2. Context parallelism keeps each
rank's s/cp tokens through the whole layer (sharding.py: two chunks per rank, zigzag for an
even causal load) and brings the other ranks' keys and values to attention in one of three
ways, all exact and all behind one call:

  ring       ring.py       K/V blocks passed around the ring, overlapped with compute,
                           partial results merged through their log-sum-exps (blocks.py)
  allgather  allgather.py  all K/V gathered once, then the same blocks computed locally
  ulysses    ulysses.py    all-to-all: all tokens of h/cp heads, plain attention, swap back
  hierarchical  hierarchical.py  Ulysses inside groups of cp_a2a ranks, the ring across the
                           groups (Megatron-Core's a2a+p2p; grid.cp_a2a, grid.cp_ring)

    out = context_parallel_attention(q, k, v, grid, variant="ring", causal=True)

q [b, hq, s/cp, d], k/v [b, hkv, s/cp, d] hold this rank's tokens in sharding.positions
order; out [b, hq, s/cp, d] too. Gradients flow to q, k and v (each variant is an autograd
function or built from them).
"""
from __future__ import annotations

import torch

from ..runtime.comm import Group
from ..kernels import ops
from .allgather import allgather_attention
from .ring import ring_attention, ring_bytes
from .sharding import (LAYOUTS, attention_flops_per_rank, chunk_ids, gathered_order, imbalance,
                       positions, scores_per_rank, shard_sequence, unshard_sequence)
from .hierarchical import hierarchical_attention, hierarchical_bytes
from .ulysses import check_heads, ulysses_attention

VARIANTS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
            "hierarchical": hierarchical_attention}


def check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"context-parallel variant {variant!r}: choose one of {sorted(VARIANTS)}")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid,
                               variant: str = "ring", causal: bool = True, layout: str = "zigzag",
                               scale: float | None = None, use_kernels: bool = False,
                               drop: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v of this rank's queries over the whole sequence.

    grid: a Grid (its cp group is used; hierarchical: its cp_a2a and cp_ring) or a comm.Group
    (hierarchical: the pair (cp_a2a, cp_ring)). use_kernels: each block on minitron's
    flash-attention kernel where it can run (a GPU, or Triton's interpreter). drop: dropout
    weights keep/(1-p) [b, hq, s, s] indexed by *global* positions (the reference's mask for
    this rank's heads); blocks with dropout run in torch.
    """
    check_variant(variant)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")
    if variant == "hierarchical":
        group = grid if isinstance(grid, tuple) else (grid.cp_a2a, grid.cp_ring)
        cp = group[0].size * group[1].size
    else:
        group = grid if isinstance(grid, Group) else grid.cp
        cp = group.size
    if q.shape[2] % 2:
        raise ValueError(f"each rank holds two chunks of its {q.shape[2]} tokens: use a sequence "
                         f"length divisible by 2*cp={2 * cp}")
    use_kernels = use_kernels and ops._triton_path(q)
    return VARIANTS[variant](q, k, v, group, causal=causal, layout=layout, scale=scale,
                             use_kernels=use_kernels, drop=drop)


__all__ = ["VARIANTS", "LAYOUTS", "context_parallel_attention", "check_variant", "check_heads",
           "ring_attention", "allgather_attention", "ulysses_attention", "hierarchical_attention",
           "ring_bytes", "hierarchical_bytes",
           "chunk_ids", "positions", "gathered_order", "shard_sequence", "unshard_sequence",
           "scores_per_rank", "attention_flops_per_rank", "imbalance"]
