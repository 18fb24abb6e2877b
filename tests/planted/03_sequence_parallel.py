"""Planted wrong answer for exercises/03_sequence_parallel.ipynb: the layer saves the gathered
sequence instead of its shard, so backward needs no re-gather. Every number it computes is
right, and it sends less; but it saves t times the bytes the re-gather exists to save, which
Check 1 shows."""

WRONG = {
    "11b4307f": '''class RegatherColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, weight, group):
        ctx.group = group
        x = comm.all_gather(x_local, group, dim=SEQ)
        ctx.save_for_backward(x, weight)                  # wrong: the gathered sequence, not the shard
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        d_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        d_x = comm.reduce_scatter(grad @ weight, ctx.group, dim=SEQ)
        return d_x, d_weight, None
''',
}

# The grader's summary line must contain "FAIL at " + FAILS_AT.
FAILS_AT = "Check 1"
