"""Cross entropy over a vocabulary split across the tensor-parallel group.

The output layer is column-parallel: rank r holds the logits of vocabulary rows
[r*V/tp, (r+1)*V/tp) for every token. Gathering the full [N, V] logits would cost
N*V*4 bytes per rank; this function needs only three all-reduces of N floats.

For one token with logits x_1..x_V and target t:

    loss = log sum_j exp(x_j) - x_t

1. Max. exp overflows for large x, so shift by a constant m first:
       log sum_j exp(x_j) = m + log sum_j exp(x_j - m).
   Any m gives the same value; m = max_j x_j keeps every exponent <= 0. Each rank
   only sees its shard, so the global max is an all-reduce with op max. (The local
   max would also be safe for the local sum, but then the ranks' sums would be at
   different scales and could not simply be added.)
2. Target logit. Exactly one rank owns column t. That rank contributes x_t - m, the
   others contribute 0, and an all-reduce (sum) gives every rank x_t - m. Without it
   the ranks that do not own t would compute the loss with a zero target logit.
3. Sum of exp. Each rank sums exp(x_j - m) over its columns; an all-reduce (sum)
   gives the global sum S. Then loss = log S - (x_t - m), the same on every rank.

Backward needs no communication: dloss/dx_j = softmax_j - [j == t], and the
softmax of this rank's columns is exp(x_j - m) / S, where m and S are already
global. Each rank writes the gradient of its own shard, scaled by the incoming
gradient of the loss.

Ignored tokens. A target equal to ignore_index (-100, as in torch) gets loss 0 and no
gradient, in both functions below; the mean over the other tokens is then what
F.cross_entropy(..., ignore_index=-100) returns. Any other target outside [0, V) is a
ValueError, in both functions alike, before any communication.

Everything is computed in float32 whatever the logits' dtype (half precision loses
the small probabilities); the gradient is returned in the logits' dtype.
"""
from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.comm import Group
from ..kernels import ops   # imports no triton until a kernel first runs


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: Group, ignore_index: int):
        x = logits.float()
        v_local = x.shape[-1]
        vocab_start = group.rank * v_local

        # 1. global max, then shift (a constant per token: it does not change the loss)
        m = x.max(dim=-1).values
        comm.all_reduce(m, group, op="max")
        x = x - m.unsqueeze(-1)

        # 2. the target logit: this rank's value if it owns the target, else 0; sum
        local = targets - vocab_start
        ignored = targets == ignore_index
        mine = (local >= 0) & (local < v_local) & ~ignored
        local = local.masked_fill(~mine, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0).contiguous()
        comm.all_reduce(target_logit, group, op="sum")

        # 3. the sum of exp(x - max) over the whole vocabulary
        exp = x.exp_()  # x is our own float32 copy: reuse its memory
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group, op="sum")

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # what backward needs, already normalised
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, mine, ignored = ctx.saved_tensors
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        # (softmax - onehot) * scale without a dense one-hot: one pass over the logits, then
        # the target columns this rank owns rewritten as (s_t - 1) * scale (the same bits)
        grad = softmax * scale
        at = (*mine.nonzero(as_tuple=True),)
        at = (*at, local[at])
        grad[at] = (softmax[at] - 1) * scale[at[:-1]].squeeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None


def _check(logits_shard: torch.Tensor, targets: torch.Tensor, group: Group, ignore_index: int):
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits shard {tuple(logits_shard.shape)} must be targets' shape "
                         f"{tuple(targets.shape)} plus a vocabulary dimension")
    ops.check_targets(targets, logits_shard.shape[-1] * group.size, ignore_index)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor,
                                 group: Group, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (float32, shape of `targets`) from this rank's logits shard [..., V/tp].

    `targets` holds global vocabulary ids in [0, V), or ignore_index for a token that has no
    loss (it gets 0 and no gradient). Every rank gets the same losses. Take `.mean()` of the
    result for the training loss, or with ignored tokens the mean over the others.
    """
    _check(logits_shard, targets, group, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, group, ignore_index)


def fused_vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor,
                                       group: Group, ignore_index: int = -100) -> torch.Tensor:
    """The same per-token losses through minitron.kernels (Triton; see kernels/cross_entropy.py).

    One kernel reads each row of the shard once for its max, sum of exp and target logit, and
    backward writes the gradient in one pass. It takes TWO all-reduces where the function above
    takes three: the max of N floats, then the sum of exp and the target logit stacked into one
    all-reduce of 2N floats. The same 3N floats cross the wire, in one call fewer.
    """
    _check(logits_shard, targets, group, ignore_index)
    v_local = logits_shard.shape[-1]
    losses = ops.vocab_parallel_cross_entropy(
        logits_shard.reshape(-1, v_local), targets.reshape(-1), group.rank * v_local,
        lambda t: comm.all_reduce(t, group, op="max"), lambda t: comm.all_reduce(t, group, op="sum"),
        ignore_index)
    return losses.view(targets.shape)
