"""Sequence parallelism's all-gather and reduce-scatter hidden behind the GEMMs that need them.

Plain SP (layers.py) gathers the whole sequence, then multiplies: the column-parallel GEMM
cannot start until the last byte has arrived, and the row-parallel GEMM's reduce-scatter cannot
start until the whole GEMM has finished. The "collective matmul" (Wang et al. 2022, what
torchtitan's async TP and Transformer Engine's userbuffers do) cuts both into the n sequence
chunks the ranks hold and passes the chunks around a ring, one neighbour at a time, so that
every message travels while a GEMM on a chunk that has already arrived runs:

  all-gather + GEMM (column layer, x_j = rank j's tokens), rank r at step k = 0 .. n-1:
      start: send the chunk held to rank r+1, receive the next from rank r-1  (k < n-1)
      GEMM:  y[chunk (r-k) mod n] = x_(r-k) W^T                           <- the message flies
      wait for the message; it is the chunk for step k+1

  GEMM + reduce-scatter (row layer, P_r = this rank's partial sums), rank r at step k:
      GEMM:  p = P_r[chunk c] with c = (r+k+1) mod n                      <- step k-1's message flies
      wait:  p += the running sum for chunk c that rank r+1 sent at step k-1
      start: send p to rank r-1 (k < n-1); at k = n-1, c = r and p is the full sum of our chunk

Backward swaps them (the adjoint of an all-gather is a reduce-scatter): the column layer's
dL/dx is a GEMM + reduce-scatter, the row layer's gathers dL/dy chunk by chunk behind the
dL/dx and dL/dW GEMMs. n-1 messages of one chunk each: (n-1)/n of the full tensor, exactly the
wire bytes of the ring all-gather or reduce-scatter they replace (minitron.runtime.comm counts
them as send/recv). Only the order of the floating-point sums differs from plain SP.

The three GEMMs of each chunk (forward, dL/dx, dL/dW) are a `RingGemms`: plain F.linear and
matmuls here, or FP8 ones (fp8_linear.FP8RingGemms, when the layer has an FP8 state), which
take one scale per logical tensor before the ring starts (each rank's amax of its chunk,
all-reduced over the amax group, is the whole tensor's amax) and cast chunk by chunk with it:
the casts are elementwise, so every chunk's FP8 numbers are those the unchunked layer casts.
The block-scaled ones (fp8_blocks.BlockRingGemms) cast the forward's and dL/dx's operands chunk
by chunk too (their tiles run along the features, within a chunk's rows), but dL/dW's tiles run
along the tokens, across the chunks: `wgrad_whole` has the ring run dL/dW once, after it, on
the gathered tensors, as the unchunked layer does.

The messages go through comm_async.exchange; a `recording()` block collects each GEMM chunk
and each message as (kind, label, start, end) on time.perf_counter's clock: the timeline
python -m minitron.bench overlap --tp 2 draws.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..runtime import comm_async
from ..runtime.comm import P2P, Group
from ..runtime.recorder import Recorder
from .mappings import SEQ_DIM
from .weight_grad import STORE, _accumulate

# ---- the measured timeline -------------------------------------------------------------
_timeline = Recorder()


def recording():
    """`with recording() as events:` collects ("gemm" | "comm", label, start, end) per chunk."""
    return _timeline.recording()


_record = _timeline.record


@contextlib.contextmanager
def _gemm(label: str):
    t0 = time.perf_counter()
    yield
    _record("gemm", label, t0, time.perf_counter())


def _wait(pending: comm_async.Pending, label: str) -> None:
    pending.wait()
    _record("comm", label, pending.started, pending.finished)


# ---- the two rings (no autograd: forward and backward both call them) --------------------
def _chunk(t: torch.Tensor, i: int, size: int) -> torch.Tensor:
    return t.narrow(SEQ_DIM, i * size, size)


def ring_gather(x: torch.Tensor, group: Group, compute: Callable[[int, torch.Tensor], None],
                what: str) -> None:
    """Pass the sequence chunks around the ring; compute(j, x_j) runs on each chunk (rank j's)
    while the next one travels. Every rank sees every chunk once, its own first."""
    n, r = group.size, group.rank
    held = x.contiguous()
    for k in range(n):
        pending = None
        if k < n - 1:
            incoming = torch.empty_like(held)
            pending = comm_async.exchange([P2P("send", held, (r + 1) % n),
                                           P2P("recv", incoming, (r - 1) % n)], group)
        source = (r - k) % n                     # who sent it first
        with _gemm(f"{what} chunk {k}"):
            compute(source, held)
        if pending is not None:
            _wait(pending, f"{what} message {k}")
            held = incoming


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group: Group,
                        what: str) -> torch.Tensor:
    """sum over ranks of partial(c), for this rank's chunk c only: each rank adds its partial
    for chunk c to the running sum its right neighbour sent, computing the next partial while
    that sum travels. Returns the full sum of chunk `group.rank`."""
    n, r = group.size, group.rank
    pending = running = incoming = None
    for k in range(n):
        c = (r + k + 1) % n
        with _gemm(f"{what} chunk {k}"):
            p = partial(c)
        if pending is not None:
            _wait(pending, f"{what} message {k - 1}")
            p = p + incoming
        if k < n - 1:
            running, incoming = p.contiguous(), torch.empty_like(p, memory_format=torch.contiguous_format)
            pending = comm_async.exchange([P2P("send", running, (r - 1) % n),
                                           P2P("recv", incoming, (r + 1) % n)], group)
    return p


# ---- the GEMMs on one chunk ----------------------------------------------------------------
class RingGemms:
    """The GEMMs the rings run on each chunk, in the activations' dtype. A subclass (FP8's) takes
    its scales in begin_forward / begin_backward, before any chunk is multiplied."""
    wgrad_dtype = None                     # dL/dW accumulates in the weight's dtype
    wgrad_whole = False                    # True: dL/dW as one GEMM on the gathered tensors,
                                           # after the ring (its casts' tiles run along the tokens)

    def begin_forward(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        pass

    def begin_backward(self, dy: torch.Tensor) -> None:
        pass

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def dgrad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dy @ weight

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _flat(dy).t() @ _flat(x)


PLAIN = RingGemms()


# ---- dL/dW now, or queued for a zero-bubble schedule's W pass (weight_grad.py) -----------
def _deferring(ctx) -> bool:
    return ctx.deferrable and STORE.key is not None


def _weight_grad_now(ctx, weight: torch.Tensor) -> torch.Tensor | None:
    """A zero buffer the ring accumulates dL/dW into, chunk by chunk; None when it is deferred
    or not wanted (a frozen weight)."""
    wanted = ctx.needs_input_grad[1] and not _deferring(ctx)
    return torch.zeros_like(weight, dtype=ctx.gemms.wgrad_dtype or weight.dtype) if wanted else None


def _defer(weight: torch.Tensor, compute: Callable[[], torch.Tensor], nbytes: int) -> None:
    @torch.no_grad()
    def weight_grad():
        _accumulate(weight, compute())
    STORE.put(weight_grad, nbytes)
    STORE.waiting[weight] = STORE.waiting.get(weight, 0) + 1


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# ---- the autograd functions ----------------------------------------------------------------
class _AllGatherMatmul(torch.autograd.Function):
    """y = all_gather_seq(x) W^T, the gather chunk by chunk behind the GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, gemms):
        n, size = group.size, x.shape[SEQ_DIM]
        chunks, outs = [None] * n, [None] * n
        gemms.begin_forward(x, weight)

        def gemm(j, xj):
            chunks[j], outs[j] = xj, gemms.forward(xj, weight)
        ring_gather(x, group, gemm, "all-gather x")
        ctx.group, ctx.size, ctx.deferrable, ctx.gemms = group, size, STORE.capturing, gemms
        ctx.weight = weight
        x_full = torch.cat(chunks, dim=SEQ_DIM)     # kept for dL/dW, as plain SP's F.linear does
        ctx.save_for_backward(x_full, weight)
        return torch.cat(outs, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, dy):
        x_full, weight = ctx.saved_tensors
        size, defer, gemms = ctx.size, _deferring(ctx) and ctx.needs_input_grad[1], ctx.gemms
        dw = _weight_grad_now(ctx, weight)
        gemms.begin_backward(dy)

        def partial(c):                  # this rank's share of dL/dx for chunk c (and of dL/dW)
            dyc = _chunk(dy, c, size)
            if dw is not None and not gemms.wgrad_whole:
                dw.add_(gemms.wgrad(dyc, _chunk(x_full, c, size)))
            return gemms.dgrad(dyc, weight)
        dx = ring_reduce_scatter(partial, ctx.group, "reduce-scatter dL/dx")
        if dw is not None and gemms.wgrad_whole:
            with _gemm("dL/dW"):
                dw.add_(gemms.wgrad(dy, x_full))
        if defer:
            _defer(ctx.weight, lambda: gemms.wgrad(dy, x_full).to(weight.dtype), dy.numel() * dy.element_size())
        return dx, None if dw is None else dw.to(weight.dtype), None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """y = reduce_scatter_seq(x W^T), the reduce-scatter chunk by chunk behind the GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, gemms):
        n = group.size
        if x.shape[SEQ_DIM] % n:
            raise ValueError(f"the sequence of {x.shape[SEQ_DIM]} tokens does not split into "
                             f"tp={n} equal chunks: use a multiple of {n}")
        size = x.shape[SEQ_DIM] // n
        ctx.group, ctx.size, ctx.deferrable, ctx.gemms = group, size, STORE.capturing, gemms
        ctx.weight = weight
        ctx.save_for_backward(x, weight)
        gemms.begin_forward(x, weight)
        return ring_reduce_scatter(lambda c: gemms.forward(_chunk(x, c, size), weight), group,
                                   "reduce-scatter y")

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        n, size, defer = ctx.group.size, ctx.size, _deferring(ctx) and ctx.needs_input_grad[1]
        gemms = ctx.gemms
        dw = _weight_grad_now(ctx, weight)
        dxs, dys = [None] * n, [None] * n
        gemms.begin_backward(dy)

        def gemm(j, dyj):
            dxs[j], dys[j] = gemms.dgrad(dyj, weight), dyj
            if dw is not None and not gemms.wgrad_whole:
                dw.add_(gemms.wgrad(dyj, _chunk(x, j, size)))
        ring_gather(dy, ctx.group, gemm, "all-gather dL/dy")
        dy_full = torch.cat(dys, dim=SEQ_DIM) if defer or gemms.wgrad_whole else None
        if dw is not None and gemms.wgrad_whole:
            with _gemm("dL/dW"):
                dw.add_(gemms.wgrad(dy_full, x))
        if defer:
            _defer(ctx.weight, lambda: gemms.wgrad(dy_full, x).to(weight.dtype),
                   dy_full.numel() * dy_full.element_size())
        return torch.cat(dxs, dim=SEQ_DIM), None if dw is None else dw.to(weight.dtype), None, None


def allgather_matmul(x: torch.Tensor, weight: torch.Tensor, group: Group,
                     gemms: RingGemms = PLAIN) -> torch.Tensor:
    """[b, s/n, h] sequence shard -> [b, s, out/n]: a column-parallel GEMM after SP's all-gather."""
    return F.linear(x, weight) if group.size == 1 else _AllGatherMatmul.apply(x, weight, group, gemms)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group,
                          gemms: RingGemms = PLAIN) -> torch.Tensor:
    """[b, s, in/n] -> [b, s/n, out]: a row-parallel GEMM before SP's reduce-scatter."""
    return F.linear(x, weight) if group.size == 1 else _MatmulReduceScatter.apply(x, weight, group, gemms)
