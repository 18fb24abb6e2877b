"""Tensor-parallel layers and the f/g operators against single-device nn.Linear / F.embedding.

Every rank builds the same full weights from the same seed, keeps its shard, and compares
its outputs, input gradient and (gathered) weight gradients with the reference. The
communication of each forward and backward is counted and asserted exactly.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitron.runtime import comm
from minitron.grid import ParallelConfig, build_grid
from minitron.tensor_parallel import layers, mappings
from minitron.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding)
from minitron.verify.compare import rel_err

B, S, H, FFN, V = 2, 8, 16, 64, 32
F32 = 4
TOL_OUT, TOL_GRAD = 1e-5, 1e-4


# ---- helpers that run inside the ranks ----
def _tp(sp: bool):
    return build_grid(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=sp)).tp


def _full(shape, seed, dtype=torch.float32):
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _seq(t, group):
    """This rank's part of the sequence (dim 1)."""
    return t.chunk(group.size, dim=1)[group.rank]


def _linear(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin


def _load(layer, weight, bias=None):
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


# ---- workers ----
def _column(gather_output, sp):
    group = _tp(sp)
    n, r = group.size, group.rank
    W, b, X, G = _full((FFN, H), 1), _full((FFN,), 2), _full((B, S, H), 3), _full((B, S, FFN), 4)
    ref_x = X.clone().requires_grad_()
    lin = _linear(W, b)
    y_ref = lin(ref_x)
    (y_ref * G).sum().backward()

    layer = _load(ColumnParallelLinear(H, FFN, group, gather_output=gather_output, sequence_parallel=sp),
                  W.chunk(n, 0)[r], b.chunk(n, 0)[r])
    x = (_seq(X, group) if sp else X).clone().requires_grad_()
    with comm.counting() as fwd:
        y = layer(x)
    with comm.counting() as bwd:
        (y * (G if gather_output else G.chunk(n, -1)[r])).sum().backward()
    errs = {"y": rel_err(y, y_ref if gather_output else y_ref.chunk(n, -1)[r]),
            "dx": rel_err(x.grad, _seq(ref_x.grad, group) if sp else ref_x.grad),
            "dW": rel_err(comm.all_gather(layer.weight.grad, group, 0), lin.weight.grad),
            "db": rel_err(comm.all_gather(layer.bias.grad, group, 0), lin.bias.grad)}
    return errs, fwd.as_dict(), bwd.as_dict()


def _row(input_is_parallel, sp):
    group = _tp(sp)
    n, r = group.size, group.rank
    W, b, X, G = _full((H, FFN), 1), _full((H,), 2), _full((B, S, FFN), 3), _full((B, S, H), 4)
    ref_x = X.clone().requires_grad_()
    lin = _linear(W, b)
    y_ref = lin(ref_x)
    (y_ref * G).sum().backward()

    layer = _load(RowParallelLinear(FFN, H, group, input_is_parallel=input_is_parallel,
                                    sequence_parallel=sp), W.chunk(n, 1)[r], b)
    x = (X.chunk(n, -1)[r] if input_is_parallel else X).clone().requires_grad_()
    with comm.counting() as fwd:
        y = layer(x)
    with comm.counting() as bwd:
        (y * (_seq(G, group) if sp else G)).sum().backward()
    errs = {"y": rel_err(y, _seq(y_ref, group) if sp else y_ref),
            "dx": rel_err(x.grad, ref_x.grad.chunk(n, -1)[r] if input_is_parallel else ref_x.grad),
            "dW": rel_err(comm.all_gather(layer.weight.grad, group, 1), lin.weight.grad)}
    db = layer.bias.grad.clone()
    errs["db_before_sync"] = rel_err(db, lin.bias.grad)
    if getattr(layer.bias, "sequence_parallel", False):
        comm.all_reduce(db, group)  # each rank saw only its tokens: sum the partial grads
    errs["db"] = rel_err(db, lin.bias.grad)
    return errs, fwd.as_dict(), bwd.as_dict()


def _mlp(sp, break_f=False):
    """Column(h -> ffn) -> GeLU -> Row(ffn -> h), the pair Megatron's MLP is made of."""
    group = _tp(sp)
    n, r = group.size, group.rank
    W1, b1, W2, b2 = _full((FFN, H), 1), _full((FFN,), 2), _full((H, FFN), 3), _full((H,), 4)
    X, G = _full((B, S, H), 5), _full((B, S, H), 6)
    ref_x = X.clone().requires_grad_()
    l1, l2 = _linear(W1, b1), _linear(W2, b2)
    y_ref = l2(F.gelu(l1(ref_x)))
    (y_ref * G).sum().backward()

    fc1 = _load(ColumnParallelLinear(H, FFN, group, sequence_parallel=sp), W1.chunk(n, 0)[r],
                b1.chunk(n, 0)[r])
    fc2 = _load(RowParallelLinear(FFN, H, group, sequence_parallel=sp), W2.chunk(n, 1)[r], b2)
    x = (_seq(X, group) if sp else X).clone().requires_grad_()
    original = layers.copy_to_tensor_model_parallel_region
    if break_f:  # the planted bug: f without its backward all-reduce
        layers.copy_to_tensor_model_parallel_region = lambda t, group: t
    try:
        with comm.counting() as fwd:
            y = fc2(F.gelu(fc1(x)))
        with comm.counting() as bwd:
            (y * (_seq(G, group) if sp else G)).sum().backward()
    finally:
        layers.copy_to_tensor_model_parallel_region = original
    db2 = fc2.bias.grad.clone()
    if sp:
        comm.all_reduce(db2, group)
    errs = {"y": rel_err(y, _seq(y_ref, group) if sp else y_ref),
            "dx": rel_err(x.grad, _seq(ref_x.grad, group) if sp else ref_x.grad),
            "dW1": rel_err(comm.all_gather(fc1.weight.grad, group, 0), l1.weight.grad),
            "db1": rel_err(comm.all_gather(fc1.bias.grad, group, 0), l1.bias.grad),
            "dW2": rel_err(comm.all_gather(fc2.weight.grad, group, 1), l2.weight.grad),
            "db2": rel_err(db2, l2.bias.grad)}
    return errs, fwd.as_dict(), bwd.as_dict()


def _tokens():
    t = (torch.arange(B * S) * 5) % V  # hits every shard of the vocabulary
    t[-1] = t[0]                       # and one row twice: its gradient must accumulate
    return t.view(B, S)


def _embedding(sp):
    group = _tp(sp)
    n, r = group.size, group.rank
    W, G, tokens = _full((V, H), 1), _full((B, S, H), 2), _tokens()
    ref_w = W.clone().requires_grad_()
    y_ref = F.embedding(tokens, ref_w)
    (y_ref * G).sum().backward()

    layer = _load(VocabParallelEmbedding(V, H, group, sequence_parallel=sp), W.chunk(n, 0)[r])
    with comm.counting() as fwd:
        y = layer(tokens)
    with comm.counting() as bwd:
        (y * (_seq(G, group) if sp else G)).sum().backward()
    errs = {"y": rel_err(y, _seq(y_ref, group) if sp else y_ref),
            "dW": rel_err(comm.all_gather(layer.weight.grad, group, 0), ref_w.grad)}
    return errs, fwd.as_dict(), bwd.as_dict()


# name -> (operator, is its input replicated?, is its output replicated?)
MAPPINGS = {
    "copy_to_tp (f)": (mappings.copy_to_tensor_model_parallel_region, True, False),
    "reduce_from_tp (g)": (mappings.reduce_from_tensor_model_parallel_region, False, True),
    "scatter_to_tp": (mappings.scatter_to_tensor_model_parallel_region, True, False),
    "gather_from_tp": (mappings.gather_from_tensor_model_parallel_region, False, True),
    "scatter_to_sp": (mappings.scatter_to_sequence_parallel_region, True, False),
    "gather_from_sp": (mappings.gather_from_sequence_parallel_region, False, False),
    "reduce_scatter_to_sp": (mappings.reduce_scatter_to_sequence_parallel_region, False, False),
}


def _adjoints():
    """<M x, y> = <x, M^T y> with M^T from autograd, inner products over the whole group.

    A replicated tensor is one value held by every rank (count it once); a distributed one
    is a different value per rank (sum over ranks). Float64, so equality is to rounding."""
    group = _tp(False)
    n, r = group.size, group.rank

    def inner(a, b, replicated):
        local = (a * b).sum().reshape(1)
        return local if replicated else comm.all_reduce(local, group)

    out = {}
    for name, (op, in_rep, out_rep) in MAPPINGS.items():
        x = _full((2, 2 * n, 3 * n), 10 if in_rep else 20 + r, torch.float64).requires_grad_()
        y_ = op(x, group)
        y = _full(tuple(y_.shape), 30 if out_rep else 40 + r, torch.float64)
        y_.backward(y)
        out[name] = (inner(y_.detach(), y, out_rep).item(), inner(x.detach(), x.grad, in_rep).item())

    # f and g on rank-valued tensors: the sum over ranks of r is n(n-1)/2
    x = torch.zeros(3, requires_grad=True)
    mappings.copy_to_tensor_model_parallel_region(x, group).backward(torch.full((3,), float(r)))
    g = mappings.reduce_from_tensor_model_parallel_region(torch.full((3,), float(r)), group)
    out["f_backward"], out["g_forward"] = x.grad.tolist(), g.tolist()
    return out


def _relu_split():
    """Y = relu(X A) with X = [1, 1], A = [[1, 3], [-2, 1]] on 2 ranks."""
    group = _tp(False)
    r = group.rank
    X, A = torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 3.0], [-2.0, 1.0]])
    full = torch.relu(X @ A)                               # [[0, 4]]
    # rows of A (and columns of X) split: each rank holds a partial sum of every output
    partial = X[:, r:r + 1] @ A[r:r + 1, :]                # rank 0: [1, 3], rank 1: [-2, 1]
    nonlinear_first = comm.all_reduce(torch.relu(partial), group)   # relu before the sum: wrong
    sum_first = torch.relu(comm.all_reduce(partial.clone(), group))  # a sync first: right again
    # columns of A split: each rank holds complete outputs, relu is safe without any sync
    column = comm.all_gather(torch.relu(X @ A[:, r:r + 1]), group, dim=1)
    return full.tolist(), nonlinear_first.tolist(), sum_first.tolist(), column.tolist()


# ---- expected communication ----
def _rec(op, payload, n, calls=1):
    share = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
             "reduce_scatter": (n - 1) / n}[op]
    return {f"tp/{op}": {"calls": calls, "bytes": payload, "wire_bytes": share * payload}}


def _check(errs, out_keys=("y",)):
    for k, e in errs.items():
        if k == "db_before_sync":
            continue
        assert e <= (TOL_OUT if k in out_keys else TOL_GRAD), (k, e)


# ---- tests ----
SIZES = [2, 4]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gather_output, sp", [(False, False), (True, False), (False, True)],
                         ids=["shard_out", "gather_out", "seq_parallel"])
def test_column_parallel_linear(run_ranks, n, gather_output, sp):
    act_in = B * S * H * F32
    for errs, fwd, bwd in run_ranks(_column, gather_output, sp, world_size=n):
        _check(errs)
        if sp:
            assert fwd == _rec("all_gather", act_in, n) and bwd == _rec("reduce_scatter", act_in, n)
        else:
            assert fwd == (_rec("all_gather", B * S * FFN * F32, n) if gather_output else {})
            assert bwd == _rec("all_reduce", act_in, n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("input_is_parallel, sp", [(True, False), (False, False), (True, True)],
                         ids=["parallel_in", "full_in", "seq_parallel"])
def test_row_parallel_linear(run_ranks, n, input_is_parallel, sp):
    act_out = B * S * H * F32
    for errs, fwd, bwd in run_ranks(_row, input_is_parallel, sp, world_size=n):
        _check(errs)
        if sp:
            assert fwd == _rec("reduce_scatter", act_out, n) and bwd == _rec("all_gather", act_out, n)
            # a test of the test: each rank's bias grad covers only its tokens until summed
            assert errs["db_before_sync"] > 100 * TOL_GRAD
        else:
            assert fwd == _rec("all_reduce", act_out, n)
            # a full input is split in forward, so its gradient must be gathered in backward
            assert bwd == ({} if input_is_parallel else _rec("all_gather", B * S * FFN * F32, n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_mlp_pair_communicates_once_each_way(run_ranks, n, sp):
    act = B * S * H * F32
    expected = ({**_rec("all_gather", act, n), **_rec("reduce_scatter", act, n)} if sp
                else _rec("all_reduce", act, n))
    for errs, fwd, bwd in run_ranks(_mlp, sp, world_size=n):
        _check(errs)
        assert fwd == expected and bwd == expected


def test_mlp_without_f_all_reduce_fails(run_ranks):
    """A test of the test: drop f's backward all-reduce and dL/dX is visibly wrong."""
    for errs, fwd, bwd in run_ranks(_mlp, False, True, world_size=2):
        assert errs["y"] <= TOL_OUT      # forward is untouched
        assert errs["dx"] > 100 * TOL_GRAD
        assert bwd == {}                 # and the missing all-reduce shows in the count


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_vocab_parallel_embedding(run_ranks, n, sp):
    act = B * S * H * F32
    for errs, fwd, bwd in run_ranks(_embedding, sp, world_size=n):
        _check(errs)
        if sp:
            assert fwd == _rec("reduce_scatter", act, n) and bwd == _rec("all_gather", act, n)
        else:
            assert fwd == _rec("all_reduce", act, n) and bwd == {}


@pytest.mark.parametrize("n", SIZES)
def test_mapping_backwards_are_adjoints(run_ranks, n):
    for res in run_ranks(_adjoints, world_size=n):
        for name in MAPPINGS:
            lhs, rhs = res[name]
            assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), (name, lhs, rhs)
        assert res["f_backward"] == [n * (n - 1) / 2] * 3
        assert res["g_forward"] == [n * (n - 1) / 2] * 3


def test_relu_needs_the_column_split(run_ranks):
    for full, nonlinear_first, sum_first, column in run_ranks(_relu_split, world_size=2):
        assert full == [[0.0, 4.0]]
        assert nonlinear_first == [[1.0, 4.0]]  # relu(1) + relu(-2) = 1, but relu(1 - 2) = 0
        assert sum_first == full and column == full
