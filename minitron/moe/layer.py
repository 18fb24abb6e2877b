"""The expert-parallel MoE layer: the dense MLP's interface, forward(x) -> y, on the grid.

Where everything lives (minitron/grid/'s groups):
  router          replicated on every rank; a dense parameter (its gradient is averaged over
                  dense_dp like the attention's). Under SP each tp rank routes its own
                  tokens, so its gradient is partial: marked `sequence_parallel`, summed over tp.
  experts         expert e on ep rank e // (E / ep), split by tp inside (experts.py); every
                  parameter marked `allreduce = False`: data-parallel code sums expert
                  gradients over dp_cp (the ranks holding the same expert), not dense_dp.
  tokens          dispatched over tp_ep (dispatch.py).

Why EP with TP needs sequence parallelism: the dispatcher sends each token from the one rank
of tp_ep that holds it. Without SP every tp rank holds every token of its sequence, so each
token would be sent, computed and returned tp times over (and counted tp times in the
combine). With SP the tp ranks hold disjoint slices of the sequence: each token is on exactly
one rank, as the all-to-all assumes. A row of minitron/refusals/ (experts-tp-without-sp).

The auxiliary losses and the statistics are those of the whole micro-batch (aux_loss_scope
"global", the default): the per-expert counts are summed over the ranks that hold other tokens
(dense_dp, and tp under SP; an all-reduce of E integers each), and the layer's loss term is
arranged so that the data-parallel mean (and the tp sum, through g) of the ranks' terms is the
single-device number (router.aux_losses). "replica" sums them over cp (and tp) only: each dp x ep
replica balances its own tokens, and the objective changes with the layout.

With cfg.expert_bias (aux-loss-free balancing, moe/balance.py) each forward also adds this
rank's own counts to `step_load`; after the optimizer step they are summed over load_groups()
(always the global scope's groups: the bias is one state of the replicated router, so every
replica must apply the same update) and the bias moves.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import refusals
from ..runtime import comm
from ..grid import Grid
from ..tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from .balance import ExpertBias
from .dispatch import AllGatherDispatcher, AllToAllDispatcher
from .experts import GroupedExperts
from .router import aux_losses, apply_capacity, choice_counts, route, tokens_per_expert
from ..config import ModelConfig

DISPATCHERS = ("alltoall", "allgather")


class ParallelMoE(ExpertBias):
    """This rank's share of one MoE layer; forward(x [b, s_local, h]) -> [b, s_local, h]."""

    def __init__(self, cfg: ModelConfig, grid: Grid, dispatcher: str = "alltoall"):
        super().__init__()
        refusals.check_model(grid.config, cfg)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={dispatcher!r}: choose one of {DISPATCHERS}")
        self.cfg, self.grid = cfg, grid
        self.sp = grid.sequence_parallel
        ep, tp = grid.ep.size, grid.tp.size
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg, cfg.n_experts // ep, tp)
        self._init_expert_bias(cfg)                    # float32, outside the state dict (balance.py)
        for p in self.experts.parameters():
            p.allreduce = False                        # reduced over dp_cp (data_parallel/ddp.py)
        self.router.weight.sequence_parallel = self.sp
        if self.experts.fc2.bias is not None:          # added by one tp rank per token
            self.experts.fc2.bias.sequence_parallel = self.sp
        if dispatcher == "alltoall":
            self.dispatcher = AllToAllDispatcher(grid.tp_ep, cfg.n_experts, ep, tp, grid.tp.rank)
        else:
            self.dispatcher = AllGatherDispatcher(grid.tp_ep, cfg.n_experts, ep, tp, grid.tp.rank,
                                                  grid.ep.rank)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.routing = None
        self.imposed_experts: torch.Tensor | None = None   # [n, k] verify --reference-routing only

    def _token_groups(self):
        """The groups whose ranks hold the other tokens the balance loss counts, and how many
        ranks' loss terms are averaged over them (the first group's size). "global": every
        token of the micro-batch (dense_dp = dp x ep x cp); "replica": this dp x ep replica's
        own sequences only (cp), so the loss changes with the number of replicas."""
        if self.cfg.aux_loss_scope == "global":
            return self.load_groups()
        return [self.grid.cp] + ([self.grid.tp] if self.sp else [])

    def load_groups(self):
        """Every rank holding other tokens of the batch: dense_dp, and tp under SP."""
        return [self.grid.dense_dp] + ([self.grid.tp] if self.sp else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s_local, h = x.shape
        cfg, grid = self.cfg, self.grid
        flat = x.reshape(-1, h)
        r = route(self.router(flat), cfg, self.expert_bias, self.imposed_experts)
        offsets = None
        if cfg.capacity_factor is not None and self.sp:
            # tokens of the same sequences that earlier tp ranks sent to each expert
            per_rank = comm.all_gather(choice_counts(r.experts, cfg.n_experts, b)[None], grid.tp, dim=0)
            offsets = per_rank[:grid.tp.rank].sum(0)
        seq = s_local * (grid.tp.size if self.sp else 1)
        r = apply_capacity(r, cfg, rows=b, seq=seq, offsets=offsets)
        counts = tokens_per_expert(r, cfg.n_experts)
        self.record_load(counts)                       # this rank's, before the sums below
        # Only the counts cross ranks: f_e is not differentiable, and P_e is linear in each
        # token's probabilities, so each rank's term carries its own tokens' share and the
        # gradient average over dense_dp (or the tp sum under SP) adds the shares up: no
        # reduction of probabilities, hence no all-reduce to differentiate through.
        groups = self._token_groups()
        for g in groups:
            counts = comm.all_reduce(counts, g)
        replicas = groups[0].size
        tokens = flat.shape[0] * replicas * (grid.tp.size if self.sp else 1)
        aux = aux_losses(r, cfg, counts, tokens, local_share=replicas)
        self.aux_loss = reduce_from_tensor_model_parallel_region(aux, grid.tp) if self.sp else aux
        self.tokens_per_expert, self.routing = counts, r
        return self.dispatcher(flat, r, self.experts).view(b, s_local, h)
