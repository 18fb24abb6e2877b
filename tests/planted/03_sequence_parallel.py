"""Planted wrong answer for exercises/03_sequence_parallel.ipynb: the all-gather's backward
keeps this rank's slice of the gradient instead of summing the ranks' partial gradients first
(the classic sequence-parallel bug: every rank used all s tokens, so each holds only a partial
gradient for them). Forwards are right; Check 1's backward verdict and collective count catch it."""

WRONG = {
    "11b8ecb5": '''class GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        return grad.chunk(group.size, dim=SEQ)[group.rank].contiguous(), None   # wrong: no sum


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=SEQ)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad.contiguous(), ctx.group, dim=SEQ), None
''',
}

FAILS_AT = "Check 1"
