"""Collectives started now and finished later: how communication overlaps computation.

Data parallelism starts each bucket's gradient all-reduce (or reduce-scatter) from a backward
hook, the moment the bucket's last gradient is ready, and waits for all of them only after
backward has finished: meanwhile autograd computes the earlier layers' gradients. These are
minitron.runtime.comm's collectives with torch.distributed's `async_op=True`; they are counted
exactly like the blocking ones (when they start), and a failure, which surfaces at `wait()`,
names the rank, the operation and the group.

    pending = comm_async.all_reduce(bucket, grid.dense_dp)   # returns at once
    ...                                                       # more backward
    pending.wait()                                            # bucket now holds the sum

`exchange` does the same for point-to-point messages (context parallelism's ring posts the
next key/value block, then computes on the one it holds).

Inputs must be contiguous (the result is written where the collective puts it, no copy back).
Each Pending records when it started and when the collective finished (`started`, `finished`,
time.perf_counter() seconds): a measured timeline of the overlap. With `stamp=True` (the
default) the finish is stamped by the backend's own thread, through the work's future, when the
collective completes; that is a Python callback, so gloo's thread must take the GIL from the
training thread once per collective (data parallelism's buckets pass `stamp=False` unless asked
for the exact timeline: ddp.py). With `stamp=False` it is the first moment the caller saw it
done, `poll()` or the end of `wait()`: an upper bound, as it is for a backend without futures.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .comm import _all_gather_flat, _reduce_op, _reduce_scatter_flat
from .comm_core import Group, _call, _count, _nbytes
from .comm_p2p import P2P, _peer


class Pending:
    """A collective in flight. `wait()` blocks until it is done and returns its result."""

    def __init__(self, op: str, group: Group, work, result: torch.Tensor | None,
                 finish: Callable[[], None] | None = None, *, stamp: bool = True):
        self.op, self.group, self.result = op, group, result
        self._work, self._finish = work, finish
        self.started = time.perf_counter()
        self.finished: float | None = None if work is not None else self.started
        if work is not None and stamp:
            try:
                work.get_future().add_done_callback(self._mark_finished)
            except (RuntimeError, AttributeError):   # a backend without futures: wait() marks it
                pass

    def _mark_finished(self, _future) -> None:
        if self.finished is None:
            self.finished = time.perf_counter()

    def poll(self) -> bool:
        """Whether the collective has finished (not yet waited for, perhaps); the first True
        stamps `finished` if nothing did before. Costs no GIL hand-over: the caller's thread asks."""
        if self.finished is None and self._work is not None and self._work.is_completed():
            self.finished = time.perf_counter()
        return self.finished is not None

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> torch.Tensor | None:
        if self._work is not None:
            work, self._work = self._work, None
            _call(f"wait for {self.op}", self.group, work.wait)
            if self.finished is None:
                self.finished = time.perf_counter()
            if self._finish is not None:
                self._finish()
        return self.result


def _contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (an asynchronous collective "
                         "writes into it in place); pass t.contiguous() and read the result back")


def _start(op: str, group: Group, fn: Callable) -> object:
    return _call(f"start {op}", group, fn)


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", *, stamp: bool = True) -> Pending:
    """Start an in-place all-reduce of `t`; `wait()` returns `t` holding the reduction."""
    reduce_op, divide = _reduce_op(op, group)
    _contiguous(t, "all_reduce")
    n = group.size
    if n == 1:
        return Pending("all_reduce", group, None, t)
    _count(group, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t))
    work = _start("all_reduce", group,
                  lambda: dist.all_reduce(t, op=reduce_op, group=group.pg, async_op=True))
    return Pending("all_reduce", group, work, t, (lambda: t.div_(n)) if divide else None, stamp=stamp)


def reduce_scatter(t: torch.Tensor, group: Group, op: str = "sum", *, stamp: bool = True) -> Pending:
    """Start reducing the flat `t` across ranks; `wait()` returns this rank's 1/n of it."""
    reduce_op, divide = _reduce_op(op, group)
    _contiguous(t, "reduce_scatter")
    n = group.size
    if n == 1:
        return Pending("reduce_scatter", group, None, t)
    if t.dim() != 1 or t.numel() % n:
        raise ValueError(f"reduce_scatter: expected a flat tensor whose size is a multiple of the "
                         f"group size {n}, got shape {tuple(t.shape)}: pad it to a multiple of {n}")
    out = t.new_empty(t.numel() // n)
    _count(group, "reduce_scatter", _nbytes(t), (n - 1) / n * _nbytes(t))
    work = _start("reduce_scatter", group,
                  lambda: _reduce_scatter_flat(out, t, op=reduce_op, group=group.pg, async_op=True))
    return Pending("reduce_scatter", group, work, out, (lambda: out.div_(n)) if divide else None,
                   stamp=stamp)


def all_gather(t: torch.Tensor, group: Group, out: torch.Tensor | None = None, *,
               stamp: bool = True) -> Pending:
    """Start gathering every rank's flat `t` in rank order; `wait()` returns the n*len(t) result
    (written into `out` when given)."""
    _contiguous(t, "all_gather")
    n = group.size
    if out is None:
        out = t.new_empty(n * t.numel())
    if out.shape != (n * t.numel(),) or not out.is_contiguous():
        raise ValueError(f"all_gather: out must be a contiguous flat tensor of {n * t.numel()} "
                         f"elements, got shape {tuple(out.shape)}")
    if n == 1:
        out.copy_(t.reshape(-1))
        return Pending("all_gather", group, None, out)
    _count(group, "all_gather", _nbytes(out), (n - 1) / n * _nbytes(out))
    work = _start("all_gather", group,
                  lambda: _all_gather_flat(out, t.reshape(-1), group=group.pg, async_op=True))
    return Pending("all_gather", group, work, out, stamp=stamp)


class _Batch:
    """The works of one batch_isend_irecv (one per message), waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def exchange(ops: list[P2P], group: Group) -> Pending:
    """Start sends and receives and return at once: comm.exchange without the wait, counted the
    same way (a send's bytes all cross the wire). Every peer must be another rank and every
    tensor contiguous (a receive writes into it); `wait()` returns None once all have arrived."""
    torch_ops = []
    for op in ops:
        _contiguous(op.tensor, "exchange")
        nbytes = _nbytes(op.tensor)
        _count(group, op.kind, nbytes, nbytes if op.kind == "send" else 0)
        fn = dist.isend if op.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, op.tensor, _peer(group, op.peer, "exchange"), group=group.pg))
    what = f"exchange with group ranks {sorted({op.peer for op in ops})}"
    works = _start(what, group, lambda: dist.batch_isend_irecv(torch_ops))
    return Pending(what, group, _Batch(works), None)


__all__ = ["Pending", "all_reduce", "reduce_scatter", "all_gather", "exchange"]
