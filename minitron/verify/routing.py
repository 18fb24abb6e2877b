"""The routers' choices in the comparison: how many (token, expert) choices the split model makes
differently from the reference, and `--reference-routing`, which makes it take the reference's.

Why it is needed: top-k is a discontinuity. In 16 bits the two sides round every op in
different places, so two experts whose scores for a token are within a rounding of each other
can come out in either order, and the token then goes to another expert: its output differs by
the whole expert's contribution, which no tolerance covers. A float32 run has the same risk,
only a 2^16 times smaller one.

With --reference-routing each MoE layer of the split model takes the reference's choices for
its own tokens (moe.router.route(imposed=...)); its gates are still its own router's scores at
those experts, so everything else (logits, loss, dL/dX, every gradient, the router's included,
every update) is compared at the usual tolerance of the dtype. One `moe routing` row per step,
bitwise (tolerance 0):
  without the flag   (token, expert) pairs chosen on one side and not on the other;
  with it            pairs the split model used that are not the reference's (0 unless the
                     imposing is broken), plus the tokens whose own top-k differs from the
                     reference's by more than a rounding: the reference's scores for the experts
                     the two sides disagree on must lie within NEAR_TIE spacings of the dtype
                     (at the token's largest score) for a flip to be one. A router that
                     chooses wrongly fails; the near ties it stepped over are named in the row.
A token's k choices are compared as a set (their order only orders the combine's sum).

In 16 bits and FP8 the flag is on by default (verify(reference_routing=None)): without it one
rounding flip ends the comparison of a correct split; --no-reference-routing turns it off.

Inside pipeline stages the routers run micro-batch by micro-batch, and so does the reference
(steps.reference_step). MicroBatchRouting follows the split side there: around each MoE layer's
forward it reads which global rows the micro-batch holds (the dropout RNG's row_ids, set by the
executor), imposes the reference's choices for exactly those rows, and records the choices used;
after the step every layer's choices reach rank 0 (gathered inside the stage, summed over pp,
each layer living on one pipeline rank), and the same rows as above are compared.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..context_parallel import shard_sequence, unshard_sequence
from ..runtime import comm
from ..train.step import in_row_order, replica_rows
from .checks import Row


def gather_pairs(local: torch.Tensor, grid, batch: int, microbatches: int = 1) -> torch.Tensor:
    """A per-(token, choice) tensor [n_local, k] of one MoE layer, as the whole batch's
    [b, s, k] in token order (collective): tp under SP, then cp's chunks, then ep_dp's rows
    (each replica's train.step.replica_rows, by `microbatches`)."""
    pairs = local.view(batch // grid.ep_dp.size, -1, local.shape[-1])
    if grid.sequence_parallel:
        pairs = comm.all_gather(pairs.contiguous(), grid.tp, dim=1)
    pairs = unshard_sequence(pairs, grid.cp)
    return in_row_order(comm.all_gather(pairs.contiguous(), grid.ep_dp, dim=0), grid.ep_dp.size,
                        microbatches)


def _positions(rows: torch.Tensor, grid) -> torch.Tensor:
    """This rank's sequence positions of whole rows [r, s, k]: its cp chunks, its SP slice."""
    mine = shard_sequence(rows, grid.cp.size, grid.cp.rank)
    if grid.sequence_parallel:
        mine = mine.chunk(grid.tp.size, dim=1)[grid.tp.rank]
    return mine


def local_pairs(full: torch.Tensor, grid) -> torch.Tensor:
    """The inverse of gather_pairs: this rank's [n_local, k] of the batch's [b, s, k]."""
    mine = _positions(full[replica_rows(full.shape[0], grid)], grid)
    return mine.reshape(-1, full.shape[-1]).contiguous()


NEAR_TIE = 4      # spacings of the dtype, at a token's largest score, that a flip may span


def reference_choices(ref, shape) -> list[torch.Tensor]:
    """The reference's choices of its last forward, [b, s, k] per MoE layer (the whole batch)."""
    return [m.routing.experts.view(*shape, -1) for m in ref.moe_layers()]


def reference_scores(ref, shape) -> list[torch.Tensor]:
    """The scores the reference's routers chose by, [b, s, E] per MoE layer, float32: softmax
    probabilities or logits (router_pre_softmax), plus the expert bias (router.route)."""
    out = []
    for m in ref.moe_layers():
        r = m.routing
        scores = (r.probs if m.cfg.router_pre_softmax else r.logits).detach().float()
        if m.expert_bias is not None:
            scores = scores + m.expert_bias.float()
        out.append(scores.view(*shape, -1))
    return out


def beyond_rounding(own: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, n_experts: int,
                    eps: float) -> tuple[int, int]:
    """(tokens whose top-k sets differ, those of them that differ by more than a rounding).

    own, ref [..., k]; scores [..., E] the reference's. For a token whose sets differ, the gap is
    the least reference score of the experts only the reference chose minus the largest of those
    only `own` chose: >= 0, and within NEAR_TIE * eps * (the token's largest |score|) a tie."""
    in_own, in_ref = (F.one_hot(t, n_experts).sum(-2) > 0 for t in (own, ref))
    differ = (in_own != in_ref).any(-1)
    if not differ.any():
        return 0, 0
    inf = torch.tensor(float("inf"), device=scores.device)
    ref_only = torch.where(in_ref & ~in_own, scores, inf).amin(-1)
    own_only = torch.where(in_own & ~in_ref, scores, -inf).amax(-1)
    bound = NEAR_TIE * eps * scores.abs().amax(-1)
    return int(differ.sum()), int((differ & (ref_only - own_only > bound)).sum())


def share_reference_choices(choices: list[torch.Tensor] | None, grid, n_layers: int, shape,
                            k: int) -> list[torch.Tensor]:
    """Rank 0's reference `choices`, [b, s, k] per MoE layer, on every rank (one broadcast)."""
    if grid.rank == 0:
        stacked = torch.stack(choices)
    else:
        stacked = torch.empty(n_layers, *shape, k, dtype=torch.int64, device=grid.device)
    comm.broadcast(stacked, comm.Group("world", range(grid.world_size)), src=0)
    return list(stacked)


class MicroBatchRouting:
    """Per micro-batch inside pipeline stages (module docstring): each MoE layer of this rank
    takes the reference's choices for the rows it routes (`impose`), and its choices are kept."""

    def __init__(self, model, grid, microbatches: int):
        self.grid, self.rng, self.microbatches = grid, model.rng, microbatches
        moe = [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]
        self.n_layers, self.k = len(moe), model.cfg.topk
        self.layers = {moe.index(int(i)): layer.mlp for i, layer in model.layers.items()
                       if model.cfg.is_moe_layer(int(i))}      # global MoE index -> this rank's
        self.imposed: list[torch.Tensor] | None = None
        for j, layer in self.layers.items():
            layer.forward = self._following(j, layer, layer.forward)

    def start(self, shape, imposed: list[torch.Tensor] | None) -> None:
        """A step of the global batch `shape` [b, s]; imposed: the reference's choices or None."""
        b, s = shape
        self.rows = replica_rows(b, self.grid, self.microbatches).to(self.grid.device)  # ascending
        local = _positions(torch.zeros(b // self.grid.ep_dp.size, s, self.k, dtype=torch.int64,
                                       device=self.grid.device), self.grid)
        self.used = {j: local.clone() for j in self.layers}
        self.own = {j: local.clone() for j in self.layers}
        self.imposed = imposed

    def _following(self, j, layer, forward):
        def routed(x):
            rows = torch.tensor(self.rng.row_ids(x.shape[0]), device=x.device)
            if self.imposed is not None:
                layer.imposed_experts = _positions(self.imposed[j][rows], self.grid) \
                    .reshape(-1, self.k).contiguous()
            y = forward(x)
            r, mine = layer.routing, torch.searchsorted(self.rows, rows)   # their places here
            self.used[j][mine] = r.experts.view(len(rows), -1, self.k)
            if r.own is not None:
                self.own[j][mine] = r.own.view(len(rows), -1, self.k)
            return y
        return routed

    def gathered(self, shape, which: str) -> list[torch.Tensor]:
        """Every MoE layer's `which` (used or own) choices of the step, [b, s, k], on every rank
        (collective: gathered inside this rank's stages, then summed over pp)."""
        out = torch.zeros(self.n_layers, *shape, self.k, dtype=torch.int64, device=self.grid.device)
        for j, pairs in sorted(getattr(self, which).items()):
            out[j] = gather_pairs(pairs.reshape(-1, self.k).to(out.device), self.grid, shape[0],
                                  self.microbatches)
        comm.all_reduce(out, self.grid.pp)
        return list(out)


def impose(model, choices: list[torch.Tensor] | None, grid) -> None:
    """Make each MoE layer take these choices (None: its own again)."""
    for i, layer in enumerate(model.moe_layers()):
        layer.imposed_experts = None if choices is None else local_pairs(choices[i], grid)


def differing(a: torch.Tensor, b: torch.Tensor, n_experts: int) -> int:
    """(token, expert) pairs chosen in `a` and not in `b` ([..., k] each; as sets per token)."""
    in_a, in_b = (F.one_hot(t, n_experts).sum(-2) > 0 for t in (a, b))
    return int((in_a & ~in_b).sum())


def routing_rows(step: int, used: list[torch.Tensor], own: list[torch.Tensor] | None,
                 ref_choices: list[torch.Tensor], n_experts: int,
                 ref_scores: list[torch.Tensor] | None = None, eps: float = 0.0) -> list[Row]:
    """One row (see the module docstring). `used`: the split model's choices per layer, [b, s, k];
    `own`: its own top-k where the reference's were imposed, else None; `ref_choices`: the
    reference's; `ref_scores` [b, s, E] per layer and `eps` the dtype's spacing judge own's flips."""
    if not ref_choices:
        return []
    E = n_experts
    total = sum(c.numel() for c in ref_choices)
    differ = sum(differing(u, r, E) for u, r in zip(used, ref_choices))
    if own is None:
        detail = (f"{differ} of {total} (token, expert) choices differ from the reference's: a "
                  "rounding difference flipped a top-k; --reference-routing compares the rest")
        return [Row(step, f"moe routing ({total} choices)", float(differ), 0.0,
                    detail if differ else "")]
    flips = sum(differing(o, r, E) for o, r in zip(own, ref_choices))
    tokens, wrong = 0, 0
    for o, r, sc in zip(own, ref_choices, ref_scores or []):
        t, w = beyond_rounding(o, r, sc, E, eps)
        tokens, wrong = tokens + t, wrong + w
    details = []
    if differ:
        details.append(f"{differ} of {total} choices used by the split model are not the reference's")
    if wrong:
        details.append(f"{wrong} of {tokens} tokens whose own top-k differs do so by more than "
                       f"{NEAR_TIE} roundings of the reference's scores: the router chose wrongly")
    return [Row(step, f"moe routing (reference's taken; own top-k differs in {flips} of {total}, "
                      f"{tokens - wrong} near ties)", float(differ + wrong), 0.0, "; ".join(details))]
