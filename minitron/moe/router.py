"""The router: which experts each token goes to, with what weight, and which tokens overflow.

For a token x (one row of the layer's input) the router's logits are z = W_r x, one per
expert. Two ways to turn them into k gates, as Megatron-Core offers (moe_router_pre_softmax):

  pre-softmax  (Switch)    p = softmax(z) over all E experts; keep the k largest p as gates
  post-softmax (default)   keep the k largest z; gates = softmax over those k (they sum to 1)

With the optional expert bias (aux-loss-free balancing, DeepSeek-V3) a per-expert bias b is
added to the scores for *choosing* only: the gates stay those of the unbiased scores, so b
steers load without entering the function the model computes. It is updated outside
backward, after every optimizer step: b_e += rate * sign(mean load - load_e) (see
`update_expert_bias`; the step's load summed over the ranks and micro-batches, moe/balance.py).
b is float32 whatever the scores' dtype, so `scores + b` chooses in float32.

Node-limited routing (optional, DeepSeek-V3 sec. 2.1.2; DeepSeek-V2's device-limited routing;
Megatron-Core's moe_router_num_groups / moe_router_group_topk): the E experts form G equal
groups of consecutive experts (group g: experts g*E/G .. (g+1)*E/G - 1). With G = ep (the
default of the command lines) group g is exactly ep rank g's experts, so a group stands for
the ranks of one node. Each token scores every group by the sum of its k/M largest choosing
scores (bias included), keeps the M best groups, and takes its top-k among their experts only
(`limit_groups`: the others are -inf for choosing; the gates are those of the chosen experts,
as without the limit). Its k rows then go to at most M groups' ranks.

Capacity (optional). Each expert takes at most C = ceil(capacity_factor * s * k / E) tokens
of each sequence of s tokens; the rest of its tokens are dropped in sequence order (the first
C to arrive are kept, Megatron's "position" policy). Per sequence rather than per batch, the
drops do not depend on how the batch is cut across data/expert-parallel ranks; under sequence
parallelism a sequence is cut across tp ranks, so each rank starts counting where the ranks
before it stopped (`offsets`, one all-gather of b x E counts). A dropped (token, expert) pair
contributes nothing; the residual connection carries the token on unchanged.

Auxiliary losses, added to the language-model loss:
  Switch load balancing  coeff * E * sum_e f_e * P_e, f_e the fraction of the T*k choices that
                         went to e (counted before dropping, not differentiable) and P_e the mean
                         over tokens of softmax(z)_e; it is 1 * coeff when perfectly balanced.
  z-loss (ST-MoE)        coeff * mean over tokens of logsumexp(z)^2: keeps logits small.
Both are over the whole micro-batch by default (Megatron's "global" aux loss): f_e uses counts
summed over every rank that holds other tokens, so a sharded run computes exactly the number of
one device with as many micro-batches (each micro-batch holds the same rows on any layout,
train/step.py replica_rows; ModelConfig.aux_loss_scope, moe/layer.py).
"""
from __future__ import annotations

import dataclasses
import math
import torch
import torch.nn.functional as F
from ..config import ModelConfig


@dataclasses.dataclass
class Routing:
    """The router's decision for n tokens (rows of the flattened input)."""
    experts: torch.Tensor   # [n, k] int64: the chosen experts, best first
    gates: torch.Tensor     # [n, k]: their weights in the combine (differentiable)
    probs: torch.Tensor     # [n, E]: softmax over all experts (the aux loss reads it)
    logits: torch.Tensor    # [n, E]
    keep: torch.Tensor      # [n, k] bool: False where a capacity factor dropped the pair
    own: torch.Tensor | None = None   # [n, k]: this router's own top-k when `experts` was imposed


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None,
          imposed: torch.Tensor | None = None) -> Routing:
    """Top-k gating of `logits` [n, E] (no capacity yet: keep is all True).

    `imposed` [n, k] (verification only, `minitron.verify --reference-routing`): take these
    experts instead of this router's top-k, which is kept in Routing.own. The gates are still
    this router's scores at those experts, so everything downstream stays differentiable."""
    probs = torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    scores = probs if cfg.router_pre_softmax else logits
    choose = scores if bias is None else scores + bias          # the bias steers choice only
    if cfg.max_groups is not None:                               # node-limited routing
        choose = limit_groups(choose, cfg.expert_groups, cfg.max_groups, cfg.topk)
    own = torch.topk(choose.detach(), cfg.topk, dim=-1).indices
    experts = own if imposed is None else imposed
    picked = scores.gather(-1, experts)
    gates = picked if cfg.router_pre_softmax else torch.softmax(picked, dim=-1)
    keep = torch.ones_like(experts, dtype=torch.bool)
    return Routing(experts, gates, probs, logits, keep, None if imposed is None else own)


def limit_groups(scores: torch.Tensor, groups: int, max_groups: int, topk: int) -> torch.Tensor:
    """`scores` [n, E] with -inf at every expert outside each token's `max_groups` best of
    `groups` equal groups, a group scored by the sum of its topk // max_groups largest scores
    (DeepSeek-V3). For choosing only."""
    n, E = scores.shape
    per_group = scores.detach().reshape(n, groups, E // groups)
    group_scores = per_group.topk(topk // max_groups, dim=-1).values.sum(-1)       # [n, G]
    best = group_scores.topk(max_groups, dim=-1).indices
    allowed = torch.zeros(n, groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return scores.masked_fill(~allowed.repeat_interleave(E // groups, dim=1), float("-inf"))


def capacity(cfg: ModelConfig, seq: int) -> int | None:
    """Tokens one expert takes from one sequence of `seq` tokens (None: dropless)."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * seq * cfg.topk / cfg.n_experts)


def choice_counts(experts: torch.Tensor, n_experts: int, rows: int) -> torch.Tensor:
    """[rows, E] int64: how many tokens of each sequence (row of the batch) chose each expert.
    `experts` is [rows * s_local, k], token-major within each row."""
    onehot = F.one_hot(experts, n_experts).sum(1)                 # [n, E] 0/1 per token
    return onehot.view(rows, -1, n_experts).sum(1)


def apply_capacity(r: Routing, cfg: ModelConfig, rows: int, seq: int,
                   offsets: torch.Tensor | None = None) -> Routing:
    """Drop the pairs past each expert's capacity, in sequence order.

    `rows` sequences of s_local = n/rows tokens each; `seq` the full sequence length (the
    capacity is per full sequence); `offsets` [rows, E]: tokens of the same sequences that ranks
    earlier in the sequence already sent to each expert (sequence parallelism), else zeros."""
    cap = capacity(cfg, seq)
    if cap is None:
        return r
    E = cfg.n_experts
    onehot = F.one_hot(r.experts, E).sum(1).view(rows, -1, E)    # [rows, s_local, E]
    arrived = onehot.cumsum(1)                                     # 1-based place in the queue
    if offsets is not None:
        arrived = arrived + offsets[:, None, :]
    place = arrived.view(-1, E).gather(-1, r.experts)              # [n, k]
    return dataclasses.replace(r, keep=place <= cap)


def tokens_per_expert(r: Routing, n_experts: int, kept_only: bool = False) -> torch.Tensor:
    """[E] int64: (token, expert) pairs per expert, before dropping unless `kept_only`."""
    experts = r.experts[r.keep] if kept_only else r.experts.reshape(-1)
    return torch.bincount(experts, minlength=n_experts)


def aux_losses(r: Routing, cfg: ModelConfig, global_counts: torch.Tensor, global_tokens: int,
               local_share: float = 1.0) -> torch.Tensor:
    """This rank's term of the Switch loss plus the z-loss (see the module docstring).

    `global_counts` [E]: choices per expert over the whole batch; `global_tokens` T the batch's
    tokens. The local terms are sums over this rank's tokens divided by T, times `local_share`
    (the number of replicas whose losses are averaged: data-parallel ranks), so that the
    replicas' mean, summed over the sequence-parallel ranks, is the batch's number."""
    E, T, k = cfg.n_experts, global_tokens, cfg.topk
    loss = r.logits.new_zeros(())
    if cfg.aux_loss_coeff:
        f = global_counts.to(r.probs.dtype) / (T * k)                # fraction of choices
        loss = loss + cfg.aux_loss_coeff * E * (f * r.probs.sum(0)).sum() / T * local_share
    if cfg.z_loss_coeff:
        z = torch.logsumexp(r.logits.float(), dim=-1).square().sum().to(r.logits.dtype)
        loss = loss + cfg.z_loss_coeff * z / T * local_share
    return loss


def imbalance(counts: torch.Tensor) -> float:
    """max / mean tokens per expert: 1.0 is perfectly balanced, E means one expert takes all."""
    counts = counts.double()
    return float(counts.max() / counts.mean()) if counts.sum() > 0 else 1.0


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
    bias += rate * torch.sign(counts.double().mean() - counts.double()).to(bias.dtype)
