"""Planted wrong answer for exercises/01_tensor_parallel_mlp.ipynb: f (CopyToTP) all-reduces in
the forward pass as well as in the backward, as if "copy to the tensor-parallel region" meant
"make the ranks agree". Every rank already holds the same X, so the forward multiplies it by t.
It runs without an error; Check 1's forward verdict and forward collective count catch it."""

WRONG = {
    "cb02463a": '''class CopyToTP(torch.autograd.Function):
    "f: identity forward; backward sums the gradients of all ranks."

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.clone(), group)  # wrong: f's forward is the identity

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.clone(), ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    "g: forward sums over the ranks; identity backward."

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTP(torch.autograd.Function):
    "Forward: concatenate every rank's tensor along the last dimension. Backward: its adjoint."

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        return grad.chunk(group.size, dim=-1)[group.rank].contiguous(), None
''',
}

FAILS_AT = "Check 1"
