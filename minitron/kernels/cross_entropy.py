"""Cross entropy fused with its log-softmax, chunked over the vocabulary.

loss = logsumexp(x) - x[target]. A program instance owns one row (token) and
walks its logits BLOCK_V at a time keeping a running max and a running sum of
exp(x - max), rescaled when the max grows (the online softmax again). So the
forward reads the logits once and writes 12 bytes a row; the [N, V]
probabilities never exist. Backward writes the only logits-shaped thing it
must, the gradient (softmax(x) - onehot(target)) * dloss, rebuilding
softmax(x) = exp(x - M - log S) from two saved numbers a row: the max M and
log S, S = sum_j exp(x_j - M). Never lse = M + log S itself: at logits near
1e4 a float32 lse is off by up to 5e-4, and so would be lse - x_target and
every exp(x - lse); x - M and log S are exact to float32 at their own scale.

Tensor (vocab) parallelism: each rank holds columns [vocab_start,
vocab_start + Vs). The same forward kernel produces that shard's partial
statistics (max, sum-exp at that max, target logit if the target is in the
shard, else 0); all-reducing the max, then the rescaled sum-exps and target
logits, gives every rank the global M, log S and x_target - M
(common.global_softmax_stats). With one shard and identity all-reduces this is
plain cross entropy.
"""
import torch
import triton
import triton.language as tl

from .common import alloc, global_softmax_stats, interpreting


@triton.jit
def _ce_partials(X, TARGETS, MAX, SUMEXP, TGT_LOGIT, stride_x, V, vocab_start, ignore_index,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x  # int64: N * V easily passes 2**31
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(X + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # what was summed so far was exp(x - m): rescale it to the new max
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    target = tl.load(TARGETS + row)
    local = target - vocab_start
    mine = (local >= 0) & (local < V) & (target != ignore_index)
    picked = tl.where(mine, tl.load(X + tl.where(mine, local, 0)).to(tl.float32), 0.0)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT_LOGIT + row, picked)


@triton.jit
def _ce_grad(X, TARGETS, MAX, LOGSUM, DLOSS, DX, stride_x, stride_dx, V, vocab_start, ignore_index,
             BLOCK_V: tl.constexpr):
    # a program owns one BLOCK_V chunk of one row: plenty of independent work
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    target = tl.load(TARGETS + row)
    m = tl.load(MAX + row)
    log_sum = tl.load(LOGSUM + row)
    dloss = tl.where(target == ignore_index, 0.0, tl.load(DLOSS + row))
    onehot = (cols == target - vocab_start).to(tl.float32)
    dx = (tl.exp((x - m) - log_sum) - onehot) * dloss  # softmax, never at the logits' scale
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _block_v(V):
    return min(triton.next_power_of_2(V), 256 if interpreting() else 4096)


def ce_partials(logits, targets, vocab_start, ignore_index):
    """(row_max, sumexp at row_max, target logit or 0), fp32 [N], for one shard."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    N, V = logits.shape
    targets = targets.contiguous()
    row_max, sumexp, tgt = (alloc((N,), torch.float32, logits.device) for _ in range(3))
    _ce_partials[(N,)](logits, targets, row_max, sumexp, tgt, logits.stride(0), V, vocab_start,
                       ignore_index, BLOCK_V=_block_v(V), num_warps=8)
    return row_max, sumexp, tgt


class CrossEntropyFn(torch.autograd.Function):
    """Per-token losses [N] of logits [N, V] (a shard when allreduce_* are given)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, allreduce_max, allreduce_sum, ignore_index):
        row_max, sumexp, tgt = ce_partials(logits, targets, vocab_start, ignore_index)
        if allreduce_max is None:  # one shard: the all-reduces are the identity
            allreduce_max = allreduce_sum = lambda t: t  # noqa: E731
        global_max, log_sum, tgt_shifted = global_softmax_stats(row_max, sumexp, tgt,
                                                                allreduce_max, allreduce_sum)
        ignored = targets == ignore_index
        ctx.save_for_backward(logits, targets, global_max, log_sum)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        return torch.where(ignored, torch.zeros_like(log_sum), log_sum - tgt_shifted)

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, global_max, log_sum = ctx.saved_tensors
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        N, V = logits.shape
        dx = alloc((N, V), logits.dtype, logits.device)
        block = _block_v(V)
        _ce_grad[(N, triton.cdiv(V, block))](logits, targets.contiguous(), global_max, log_sum,
                                             dloss.contiguous(), dx, logits.stride(0), dx.stride(0), V,
                                             ctx.vocab_start, ctx.ignore_index, BLOCK_V=block, num_warps=8)
        return dx, None, None, None, None, None
