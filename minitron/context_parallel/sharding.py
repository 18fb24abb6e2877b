"""Which tokens of a sequence each context-parallel rank holds, and what that costs it.

Context parallelism cuts every sequence into 2*cp equal chunks (0 .. 2cp-1, in order).

  "zigzag" (balanced; Megatron's get_batch_on_this_cp_rank): rank r holds chunks r and
           2cp-1-r. Under a causal mask a query sees every earlier key, so late chunks do
           more work than early ones; pairing an early chunk with its mirror gives every
           rank the same amount.
  "contiguous" (naive): rank r holds chunks 2r and 2r+1, one contiguous slice of s/cp
           tokens. Under a causal mask the last rank does about 2cp-1 times the first's work.

A rank's local tokens are its chunks concatenated in that order, so local position i is
global position `positions(...)[i]`: learned or rotary positions, targets and dropout masks
all follow it. Work is counted per (query chunk, key chunk) pair, the unit the attention
code computes: chunk a sees chunk b entirely when a > b, through the causal diagonal
(c(c+1)/2 of c*c scores) when a == b, not at all when a < b.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.comm import Group

LAYOUTS = ("zigzag", "contiguous")


def _check(s: int, cp: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")
    if cp < 1 or s % (2 * cp):
        raise ValueError(f"sequence length {s} is not divisible by 2*cp={2 * cp}: context "
                         "parallelism cuts each sequence into 2*cp chunks; pad or change cp")
    return s // (2 * cp)


def chunk_ids(cp: int, rank: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of 2*cp) that cp-rank `rank` holds, in its local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    _check(2 * cp, cp, layout)
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def positions(s: int, cp: int, rank: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions (0..s-1) of the s/cp tokens cp-rank `rank` holds, in local order."""
    c = _check(s, cp, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(cp, rank, layout)])


def gathered_order(s: int, cp: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions of the concatenation rank 0's tokens, rank 1's, ...: what an
    all-gather over cp returns. Its argsort puts a gathered sequence back in order."""
    return torch.cat([positions(s, cp, r, layout, device) for r in range(cp)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full sequence x (sequence along `dim`), in local order."""
    if cp == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp, rank, layout, x.device))


def unshard_sequence(x_local: torch.Tensor, group: Group, layout: str = "zigzag",
                     dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's local tokens: all-gather over `group`, then put
    the tokens back in order (no autograd; for comparisons and outputs)."""
    if group.size == 1:
        return x_local
    gathered = comm.all_gather(x_local.contiguous(), group, dim=dim)
    order = gathered_order(gathered.shape[dim], group.size, layout, x_local.device)
    return gathered.index_select(dim, torch.argsort(order))


# ---- work per rank ------------------------------------------------------------------------
def pair_scores(a: int, b: int, c: int, causal: bool = True) -> int:
    """Scores (query, key) query chunk a computes against key chunk b, chunks of c tokens."""
    if not causal or a > b:
        return c * c
    return c * (c + 1) // 2 if a == b else 0


def scores_per_rank(s: int, cp: int, layout: str = "zigzag", causal: bool = True) -> list[int]:
    """Per rank, the attention scores it computes against the whole sequence's keys."""
    c = _check(s, cp, layout)
    return [sum(pair_scores(a, b, c, causal) for a in chunk_ids(cp, r, layout)
                for b in range(2 * cp)) for r in range(cp)]


def attention_flops_per_rank(s: int, cp: int, layout: str = "zigzag", causal: bool = True,
                             batch: int = 1, heads: int = 1, head_dim: int = 64) -> list[int]:
    """Forward attention FLOPs per rank: 2*d for q.k and 2*d for p*v per score."""
    return [4 * batch * heads * head_dim * n for n in scores_per_rank(s, cp, layout, causal)]


def imbalance(s: int, cp: int, layout: str = "zigzag", causal: bool = True) -> float:
    """Busiest rank's work / least busy rank's: 1 means balanced (everyone waits for the max)."""
    work = scores_per_rank(s, cp, layout, causal)
    return max(work) / min(work)


__all__ = ["LAYOUTS", "chunk_ids", "positions", "gathered_order", "shard_sequence",
           "unshard_sequence", "pair_scores", "scores_per_rank", "attention_flops_per_rank",
           "imbalance"]
