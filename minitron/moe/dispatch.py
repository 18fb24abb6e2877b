"""Moving tokens to the ranks that hold their experts, and the results back.

The group is `tp_ep` (minitron/grid/): with sequence parallelism every rank of it holds
different tokens, and expert e lives on ep rank e // E_local, split across that rank's tp
ranks. Its members are numbered d = ep_rank * tp + tp_rank.

All-to-all (Megatron-Core's MoEAlltoAllTokenDispatcher), per MoE layer and step:
  1. permute   sort this rank's kept (token, expert) pairs by expert: the pairs bound for
               ep rank j are then one contiguous block, sent to each of j's tp ranks
               (each holds a slice of every one of j's experts);
  2. counts    all-to-all of the per-expert counts, so each rank knows how many rows it
               receives from whom (the uneven split sizes of step 3);
  3. dispatch  all-to-all of the rows; they arrive ordered by source, then local expert;
  4. experts   regroup by local expert, one batched matmul (experts.py);
  5. combine   undo the regrouping, all-to-all back (the same split sizes, swapped), sum the
               tp partial sums of each pair (index_add), weight by the gates and add up a
               token's k pairs: out_t = sum_k gate_tk * expert_k(x_t).
Bytes per layer forward, with M_d rows sent to member d (h values each, `elem` bytes):
  counts    R * E_local int64 per rank;  dispatch and combine  sum_d M_d * h * elem each;
backward moves the same rows the other way. Only the rows whose destination is another rank
leave it (comm counts those as wire bytes).

All-gather (Megatron-Core's MoEAllGatherTokenDispatcher): every rank gathers every token of
the group with its routing, computes its own experts' share for all of them and
reduce-scatters the result: R * n * h values per rank each way, whatever the routing, so
its traffic grows with the group while the all-to-all's stays at the k chosen copies.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.comm import Group
from ..tensor_parallel.mappings import (all_to_all, gather_from_sequence_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)
from .experts import GroupedExperts
from .router import Routing


def pairs_by_expert(r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices, their experts): the kept pairs, flattened token-major (pair = token*k +
    slot), sorted by expert; ties keep token order (a stable sort)."""
    experts = r.experts.reshape(-1)
    kept = torch.nonzero(r.keep.reshape(-1)).squeeze(1)
    order = torch.sort(experts[kept], stable=True).indices
    pairs = kept[order]
    return pairs, experts[pairs]


def combine(y_pairs: torch.Tensor, r: Routing) -> torch.Tensor:
    """[n*k, h] expert outputs per pair (zero where dropped) -> [n, h], weighted by the gates."""
    n, k = r.gates.shape
    return (y_pairs.view(n, k, -1) * r.gates[..., None]).sum(1)


class AllToAllDispatcher:
    """Steps 1-5 of the module docstring."""

    def __init__(self, group: Group, n_experts: int, ep: int, tp: int, tp_rank: int):
        self.group, self.n_experts, self.ep, self.tp, self.tp_rank = group, n_experts, ep, tp, tp_rank
        self.local = n_experts // ep

    def __call__(self, x: torch.Tensor, r: Routing, experts: GroupedExperts) -> torch.Tensor:
        n_tokens, hidden = x.shape
        top_k, n_local, n_members = r.experts.shape[1], self.local, self.group.size
        device = x.device
        # 1. permute: sorted by expert, the pairs bound for ep rank j are one block of `pairs`
        pairs, pair_experts = pairs_by_expert(r)
        pairs_per_expert = torch.bincount(pair_experts, minlength=self.n_experts)
        block_end = pairs_per_expert.cumsum(0)[n_local - 1::n_local].tolist()   # per ep rank
        block_start = [0, *block_end[:-1]]
        # Member d = j * tp + t is ep rank j's tp rank t. Each of j's tp ranks holds a slice of
        # every one of j's experts, so each gets a copy of j's whole block.
        dest_ep_rank = [j for j in range(self.ep) for _ in range(self.tp)]   # per member
        sent_pairs = torch.cat([pairs[block_start[j]:block_end[j]] for j in dest_ep_rank])
        send_splits = [block_end[j] - block_start[j] for j in dest_ep_rank]
        # 2. counts: member d learns how many rows of each of its local experts we send it
        send_counts = pairs_per_expert.view(self.ep, 1, n_local).expand(self.ep, self.tp, n_local)
        recv_counts = comm.all_to_all(send_counts.reshape(-1).contiguous(), self.group)
        recv_counts = recv_counts.view(n_members, n_local)        # [source member, local expert]
        recv_splits = recv_counts.sum(1).tolist()
        # 3. dispatch: one row per sent pair, its token's (pair = token * top_k + slot)
        rows = x[torch.div(sent_pairs, top_k, rounding_mode="floor")]
        received = all_to_all(rows, self.group, recv_splits, send_splits)
        # 4. experts: rows arrive ordered by source, then local expert; a stable sort by
        #    local expert makes each expert's rows one block for the grouped matmul. From one
        #    source (a group of one) they arrive grouped already: nothing to regroup or undo.
        rows_per_expert = recv_counts.sum(0).tolist()
        # adds_bias None: every row adds fc2's bias (tp = 1: each pair meets one shard of its expert)
        grouped, by_expert, adds_bias = received, None, None
        if n_members > 1:
            expert_of_row = torch.repeat_interleave(torch.arange(n_local, device=device).repeat(n_members),
                                                    recv_counts.reshape(-1))
            by_expert = torch.sort(expert_of_row, stable=True).indices
            grouped = received[by_expert]
        if self.tp > 1:
            # The tp ranks of an expert each return a partial sum of fc2; its bias must be
            # added once per pair: by the tp rank whose number is the source's tp rank.
            source_of_row = torch.repeat_interleave(torch.arange(n_members, device=device),
                                                    recv_counts.sum(1))
            adds_bias = (source_of_row % self.tp == self.tp_rank)[by_expert]
        y = experts(grouped, rows_per_expert, adds_bias)
        # 5. combine: back to arrival order, back to the senders (the splits swapped), and
        #    every pair's tp partial sums added up where the pair came from
        arrived = y if by_expert is None else y[torch.argsort(by_expert)]
        returned = all_to_all(arrived, self.group, send_splits, recv_splits)
        y_pairs = x.new_zeros(n_tokens * top_k, hidden).index_add(0, sent_pairs, returned)
        return combine(y_pairs, r)


class AllGatherDispatcher:
    """Every token to every rank of the group; each computes its experts' part; reduce-scatter.

    Needs the same number of tokens on every rank of the group (true under SP and DP)."""

    def __init__(self, group: Group, n_experts: int, ep: int, tp: int, tp_rank: int, ep_rank: int):
        self.group, self.tp, self.tp_rank = group, tp, tp_rank
        self.local = n_experts // ep
        self.first = ep_rank * self.local

    def __call__(self, x: torch.Tensor, r: Routing, experts: GroupedExperts) -> torch.Tensor:
        n, h = x.shape
        k = r.experts.shape[1]
        xs = gather_from_sequence_parallel_region(x, self.group, dim=0)          # [R*n, h]
        gates = gather_from_sequence_parallel_region(r.gates, self.group, dim=0)   # [R*n, k]
        chosen = comm.all_gather(r.experts, self.group, dim=0).reshape(-1)
        keep = comm.all_gather(r.keep.to(torch.uint8), self.group, dim=0).reshape(-1).bool()
        mine = keep & (chosen >= self.first) & (chosen < self.first + self.local)
        pairs = torch.nonzero(mine).squeeze(1)
        pairs = pairs[torch.sort(chosen[pairs], stable=True).indices]
        counts = torch.bincount(chosen[pairs] - self.first, minlength=self.local).tolist()
        token = torch.div(pairs, k, rounding_mode="floor")
        bias_rows = torch.div(token, n, rounding_mode="floor") % self.tp == self.tp_rank
        y = experts(xs[token], counts, bias_rows) * gates.reshape(-1)[pairs][:, None]
        out = xs.new_zeros(xs.shape).index_add(0, token, y)          # this rank's partial sums
        return reduce_scatter_to_sequence_parallel_region(out, self.group, dim=0)
