"""Every message minitron sends goes through this module, so every byte can be counted.

This file holds the collectives; the wrapper they share (counting, naming a failure) is in
comm_core.py and point-to-point (send, recv, exchange) in comm_p2p.py. Both are re-exported
here: `comm.send`, `comm.Group`, `comm.CommError` work as they always have.

Each wrapper does three things around the torch.distributed call:
  1. records (group, operation) -> calls, payload bytes and the bytes a ring algorithm
     makes each rank send ("wire bytes"), into every active `CommCounter`;
  2. tells the launcher which operation this rank is in, so a hang can be reported by name;
  3. turns a failure into a `CommError` naming the rank, the operation and the group.

Conventions. Ranks given to `send`/`recv`/`broadcast` are ranks *inside the group*
(0..group.size-1), like coordinates on the grid. A group of size 1 never communicates:
every collective returns at once and counts nothing, `exchange` copies a rank's messages to
itself locally, and `send`/`recv` refuse a peer that is this rank.

Payload S (bytes) and the per-rank wire bytes of the ring algorithms on n ranks:
  all_reduce      S = the tensor            wire = 2 (n-1)/n * S   (reduce-scatter + all-gather)
  all_gather      S = the gathered output   wire =   (n-1)/n * S
  reduce_scatter  S = the full input        wire =   (n-1)/n * S
  all_to_all      S = this rank's input     wire = the part of it that leaves the rank
  send / recv     S = the message           wire = S for send, 0 for recv
  broadcast       S = the tensor            wire = S (each rank forwards it once in a chain)
"""
from __future__ import annotations

import datetime
import threading
from typing import Callable

import torch
import torch.distributed as dist

from .comm_core import (CommError, Group, _call, _count, _in_place, _nbytes,  # noqa: F401
                        set_status_hook, single_group)
from .comm_p2p import P2P, exchange, recv, send  # noqa: F401 (re-exported: comm.send)
from .counting import TOTAL, CommCounter, Record, _active, counting  # noqa: F401 (comm.counting())

# Every process group gets this timeout (the launcher sets it): a collective that a peer
# never joins raises after it instead of hanging. torch's own default for new groups is 30 min.
TIMEOUT = datetime.timedelta(seconds=120)


# ----------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

# torch 2.13 renamed the tensor-in, tensor-out collectives; the lent GPU's torch 2.11 has
# only the old names. One shim serves both without a deprecation warning.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_plan(op: str, backend: str) -> tuple[object, bool]:
    """(the ReduceOp to run, whether to divide by the group size after): the one decision for
    "avg". NCCL averages itself (floating point: each input scaled by 1/n before the sum, so a
    16-bit sum of many ranks cannot overflow on the way); gloo has no AVG: sum, then divide."""
    if op not in (*_OPS, "avg"):
        raise ValueError(f"unknown reduction {op!r}: use one of sum, max, min, avg")
    if op != "avg":
        return _OPS[op], False
    if backend == "nccl":
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


def _reduce_op(op: str, group: Group) -> tuple[object, bool]:
    """reduce_plan for `group`'s backend (a group of one never reaches a backend)."""
    backend = dist.get_backend(group.pg) if group.size > 1 and dist.is_initialized() else "gloo"
    return reduce_plan(op, backend)


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In place: every rank ends with the reduction of all ranks' tensors."""
    reduce_op, divide = _reduce_op(op, group)  # a bad op: the caller's ValueError, not comm's
    n = group.size
    if n == 1:
        return t
    _count(group, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t))
    _call("all_reduce", group,
          lambda: _in_place(t, lambda b: dist.all_reduce(b, op=reduce_op, group=group.pg)))
    if divide:
        t.div_(n)
    return t


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's tensor along `dim` (all ranks must pass the same shape)."""
    n = group.size
    if n == 1:
        return t
    x = t.movedim(dim, 0).contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _count(group, "all_gather", _nbytes(out), (n - 1) / n * _nbytes(out))
    _call("all_gather", group, lambda: _all_gather_flat(out, x, group=group.pg))
    return out.movedim(0, dim)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Reduce across ranks, then keep this rank's 1/n slice along `dim`."""
    reduce_op, divide = _reduce_op(op, group)
    n = group.size
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {t.shape[dim]} of dim {dim} is not divisible "
                         f"by the group size {n}")
    x = t.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _count(group, "reduce_scatter", _nbytes(x), (n - 1) / n * _nbytes(x))
    _call("reduce_scatter", group,
          lambda: _reduce_scatter_flat(out, x, op=reduce_op, group=group.pg))
    if divide:
        out.div_(n)
    return out.movedim(0, dim)


def all_to_all(t: torch.Tensor, group: Group, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """Send slice i (along dim 0) of `t` to rank i; receive rank i's slice for us into row block i.

    Splits may be uneven (expert dispatch); by default every rank gets an equal share.
    """
    n = group.size
    if n == 1:
        return t
    x = t.contiguous()
    if input_split_sizes is None:
        if x.shape[0] % n:
            raise ValueError(f"all_to_all: dim 0 ({x.shape[0]}) is not divisible by {n}; "
                             "pass input_split_sizes")
        input_split_sizes = [x.shape[0] // n] * n
    elif output_split_sizes is None:
        raise ValueError("all_to_all: pass output_split_sizes with input_split_sizes (each rank "
                         "must know what it receives: exchange the counts first)")
    if output_split_sizes is None:
        output_split_sizes = [x.shape[0] // n] * n
    for name, splits in (("input", input_split_sizes), ("output", output_split_sizes)):
        if len(splits) != n or min(splits) < 0:
            raise ValueError(f"all_to_all: {name}_split_sizes {list(splits)} must hold {n} counts "
                             f">= 0, one per rank of group '{group.name}'")
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"all_to_all: input_split_sizes {list(input_split_sizes)} sum to "
                         f"{sum(input_split_sizes)}, but dim 0 of the input is {x.shape[0]}")
    row = _nbytes(x[:1]) if x.shape[0] else 0
    out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
    leaving = (x.shape[0] - input_split_sizes[group.rank]) * row
    _count(group, "all_to_all", _nbytes(x), leaving)
    hook = getattr(_in_flight, "hook", None)
    if hook is None:
        _call("all_to_all", group, lambda: dist.all_to_all_single(
            out, x, output_split_sizes, input_split_sizes, group=group.pg))
    else:                     # started now; the hook returns once it has finished (see below)
        work = _call("start all_to_all", group, lambda: dist.all_to_all_single(
            out, x, output_split_sizes, input_split_sizes, group=group.pg, async_op=True))
        hook("all_to_all", group, work, out)
    return out


# A thread may install hook(op, group, work, out): all_to_all then starts its collective
# asynchronously (async_op=True) and hands the work to the hook, which must return only once the
# work has finished. DualPipeV's overlapped pairs (pipeline/pairs.py) let the other half of the
# pair compute meanwhile. Per thread: every other thread's all-to-alls stay blocking.
_in_flight = threading.local()


def set_in_flight_hook(hook: Callable | None) -> Callable | None:
    """Install `hook` for this thread's all_to_all calls (None: blocking); returns the previous one."""
    previous = getattr(_in_flight, "hook", None)
    _in_flight.hook = hook
    return previous


def broadcast(t: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """In place: every rank receives group-rank `src`'s tensor."""
    if group.size == 1:
        return t
    _count(group, "broadcast", _nbytes(t), _nbytes(t))
    _call("broadcast", group,
          lambda: _in_place(t, lambda b: dist.broadcast(b, src=group.global_rank(src), group=group.pg)))
    return t


def barrier(group: Group) -> None:
    if group.size == 1:
        return
    _call("barrier", group, lambda: dist.barrier(group=group.pg))
