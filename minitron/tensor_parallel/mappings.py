"""The conjugate operators that put communication exactly where the math needs it.

Megatron's paper names two: f (identity forward, all-reduce backward) before a
column-parallel layer and g (all-reduce forward, identity backward) after a row-parallel
one. Each backward is the adjoint of its forward: the gradient of "copy x to every rank"
is "sum the gradients every rank computed", and the gradient of "sum" is "copy".

Sequence parallelism splits g's all-reduce into its two halves (all-reduce = reduce-scatter
+ all-gather) and moves them around the norm/dropout region:

  forward                 backward              name
  identity                all-reduce            copy_to_tensor_model_parallel_region     (f)
  all-reduce              identity              reduce_from_tensor_model_parallel_region (g)
  split last dim          all-gather last dim   scatter_to_tensor_model_parallel_region
  all-gather last dim     split last dim        gather_from_tensor_model_parallel_region
  split sequence          all-gather sequence   scatter_to_sequence_parallel_region
  all-gather sequence     reduce-scatter        gather_from_sequence_parallel_region
  reduce-scatter          all-gather sequence   reduce_scatter_to_sequence_parallel_region

Activations are [batch, sequence, hidden], so the sequence dimension is 1.

The all-to-alls are their own adjoints, with the roles swapped (as Megatron-Core's all_to_all,
all_to_all_sp2hp and all_to_all_hp2sp in the same file):

  all-to-all, splits (out, in)   all-to-all, splits (in, out)   all_to_all (MoE token dispatch)
  sequence split -> head split   head split -> sequence split   all_to_all_seq_to_heads (Ulysses)
  head split -> sequence split   sequence split -> head split   all_to_all_heads_to_seq
"""
from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.comm import Group

SEQ_DIM = 1


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous 1/n slice of `dim` (no communication)."""
    n = group.size
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {n} equal parts")
    return x.chunk(n, dim=dim)[group.rank].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # clone: the incoming gradient may be the caller's tensor (y.backward(g)) or shared
        # with another branch of the graph; an in-place all-reduce would overwrite it
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group)  # clone: never overwrite the caller's tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=-1), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used the whole sequence downstream, so each holds a partial gradient
        # for every position: sum them, and keep the slice this rank's input came from.
        return comm.reduce_scatter(grad, ctx.group, dim=ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits; its adjoint is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return comm.all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return comm.all_to_all(grad.contiguous(), ctx.group, in_splits, out_splits), None, None, None


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h, s/n, d] (this rank's tokens, all heads) -> [b, h/n, s, d] (all tokens, in
    gathered order: rank 0's, rank 1's, ...; this rank's heads)."""
    n = group.size
    b, h, sl, d = x.shape
    parts = x.reshape(b, n, h // n, sl, d).transpose(0, 1).contiguous()   # head group i -> rank i
    got = comm.all_to_all(parts, group)                                  # [n (source), b, h/n, sl, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * sl, d)


def _heads_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of _seq_to_heads."""
    n = group.size
    b, hn, s, d = y.shape
    parts = y.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # tokens of rank i
    got = comm.all_to_all(parts, group)                                         # [n (head group), ...]
    return got.transpose(0, 1).reshape(b, n * hn, s // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: forward identity, backward all-reduce (the input gradient dL/dX = sum_i D_i A_i^T)."""
    return x if group.size == 1 else _Copy.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: forward all-reduce (sum the partial outputs Y_i B_i), backward identity."""
    return x if group.size == 1 else _Reduce.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterLast.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherLast.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group,
                                        dim: int = SEQ_DIM) -> torch.Tensor:
    return x if group.size == 1 else _ScatterSeq.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group,
                                         dim: int = SEQ_DIM) -> torch.Tensor:
    return x if group.size == 1 else _GatherSeq.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group,
                                               dim: int = SEQ_DIM) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterSeq.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group: Group, output_splits: list[int],
               input_splits: list[int]) -> torch.Tensor:
    """Rows input_splits[i] of x (dim 0, in order) to rank i; output_splits[i] rows from rank i."""
    return x if group.size == 1 else _AllToAll.apply(x, group, output_splits, input_splits)


def all_to_all_seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h, s/n, d], all heads of this rank's tokens -> [b, h/n, s, d], this rank's heads of
    every token (in gathered order: rank 0's tokens, then rank 1's, ...)."""
    return _SeqToHeads.apply(x, group)


def all_to_all_heads_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse: [b, h/n, s, d] in gathered order -> [b, h, s/n, d]."""
    return _HeadsToSeq.apply(y, group)
