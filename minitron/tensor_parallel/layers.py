"""Linear layers and an embedding whose weights are split across a tensor-parallel group.

O = GeLU(X A) B, with A split by columns and B by rows (Megatron-LM, 2019):

    rank i holds A_i = A[:, cols_i] and B_i = B[rows_i, :]
    Z_i = X A_i          ColumnParallelLinear: no communication, output is a column shard
    Y_i = GeLU(Z_i)      elementwise, so it can be applied to the shard
    O   = sum_i Y_i B_i  RowParallelLinear: partial products, summed by one all-reduce

(f and g, in the comments below, are only Megatron's two communication operators: mappings.py.)

Weights follow torch's nn.Linear layout [out_features, in_features], so "split A by
columns" is "split weight by rows" here: a column-parallel weight is [out/tp, in], a
row-parallel weight is [out, in/tp].

With sequence_parallel=True the activations between blocks are split along the sequence
and the two communications become an all-gather (before the column layer) and a
reduce-scatter (after the row layer): the same bytes as one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.comm import Group
from .weight_grad import linear   # F.linear, deferrable for zero-bubble schedules (weight_grad.py)
from .overlap import PLAIN, allgather_matmul, matmul_reduce_scatter   # comm_overlap: overlap.py
from .mappings import (copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)


def _gemm(layer: nn.Module, x, weight, bias=None):
    """This layer's local GEMM: F.linear, or in FP8 once fp8_linear.enable_fp8 gave it a state."""
    state = getattr(layer, "fp8", None)
    return linear(x, weight, bias) if state is None else state.linear(x, weight, bias)


def _ring_gemms(layer: nn.Module):
    """The GEMMs overlap.py's rings run per chunk: plain, or the FP8 state's (same scales as _gemm's)."""
    state = getattr(layer, "fp8", None)
    return PLAIN if state is None else state.ring_gemms()


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {parts}")
    return n // parts


def _check_overlap(comm_overlap: bool, sequence_parallel: bool) -> None:
    if comm_overlap and not sequence_parallel:
        raise ValueError("comm_overlap hides sequence parallelism's all-gather and reduce-scatter "
                         "behind the GEMMs: it needs sequence_parallel=True")


class ColumnParallelLinear(nn.Module):
    """y_i = x A_i (+ b_i): each rank computes a slice of the output features (weight = A_i^T).

    skip_bias_add=True (Megatron's name) returns (x A_i, b_i) instead, leaving the bias to
    the caller so a fused kernel can add it together with what follows (e.g. bias + GeLU).
    comm_overlap=True (with sequence_parallel) gathers x chunk by chunk behind the GEMM.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, comm_overlap: bool = False):
        super().__init__()
        if skip_bias_add and gather_output:
            raise ValueError("skip_bias_add returns this rank's bias shard: use gather_output=False")
        _check_overlap(comm_overlap, sequence_parallel)
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.comm_overlap = comm_overlap
        self.skip_bias_add = skip_bias_add
        self.in_features, self.out_features = in_features, out_features
        local_out = _divide(out_features, group.size, "out_features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.zeros(local_out)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_overlap and self.group.size > 1:   # the gather and the GEMM in one (overlap.py)
            y = allgather_matmul(x, self.weight, self.group, _ring_gemms(self))
            if self.skip_bias_add:
                return y, self.bias
            y = y if self.bias is None else y + self.bias
            return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y
        if self.sequence_parallel:   # x is [b, s/tp, h]: gather the sequence first
            x = gather_from_sequence_parallel_region(x, self.group)
        else:                        # f: identity now, all-reduce of dL/dx in backward
            x = copy_to_tensor_model_parallel_region(x, self.group)
        if self.skip_bias_add:
            return _gemm(self, x, self.weight), self.bias
        y = _gemm(self, x, self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = sum_i x_i B_i + b: each rank multiplies its slice of the input features (weight = B_i^T)."""

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 comm_overlap: bool = False):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel RowParallelLinear needs input_is_parallel=True")
        _check_overlap(comm_overlap, sequence_parallel)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.comm_overlap = comm_overlap   # reduce-scatter chunk by chunk behind the GEMM
        self.input_is_parallel = input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        local_in = _divide(in_features, group.size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        # The bias is added once, after the sum; it is replicated on every rank. Under
        # sequence parallelism each rank adds it to its own tokens only, so its gradient is
        # partial and must be summed across the group (see grads.py).
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:   # a full input: keep our slice of its features, and
            x = scatter_to_tensor_model_parallel_region(x, self.group)  # gather dL/dx in backward
        if self.comm_overlap and self.group.size > 1:   # the GEMM and the reduce-scatter in one (overlap.py)
            y = matmul_reduce_scatter(x, self.weight, self.group, _ring_gemms(self))
            return y + self.bias if self.bias is not None else y
        partial = _gemm(self, x, self.weight)
        if self.sequence_parallel:       # sum the partials and keep our part of the sequence
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:                            # g: all-reduce now, identity in backward
            y = reduce_from_tensor_model_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank i holds rows [i*V/tp, (i+1)*V/tp) of the embedding table.

    Each rank looks up the tokens that fall in its range, writes zeros for the others, and
    one all-reduce (a reduce-scatter under sequence parallelism) assembles the full result:
    exactly one rank contributed a non-zero row for every token.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _divide(num_embeddings, group.size, "vocab_size (pad it with minitron.pad_vocab_size)")
        self.vocab_start = group.rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(x, self.group)
        return reduce_from_tensor_model_parallel_region(x, self.group)
