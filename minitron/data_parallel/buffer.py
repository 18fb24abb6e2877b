"""One flat buffer for many parameters, cut into buckets: where every element lives.

Data parallelism communicates gradients, and one big message is far cheaper than hundreds of
small ones (each pays the latency), while one message for everything could only start after
the whole backward. Megatron's answer (megatron/core/distributed/param_and_grad_buffer.py),
followed here: put all parameters (and, in a twin buffer, their gradients) end to end in one
flat tensor, and cut it into buckets of about `bucket_numel` elements. A bucket is sent as
soon as its last gradient is ready.

Order. Backward produces gradients roughly in reverse order of the forward, so parameters
are laid out in reverse: the last layer's parameters fill bucket 0, which is ready first.

Padding. Sharded optimizers (ZeRO) give rank r of n the r-th n-th of every bucket, so each
bucket is padded with zeros to a multiple of `pad_to` (n) elements. Padding elements are never
read by the model: their gradient stays 0 and Adam leaves a 0 weight at 0.

    flat:   [ bucket 0: last layer ...  pad ][ bucket 1 ... pad ] ...
    rank r owns, in bucket b: [b.start + r * b.size/n, b.start + (r+1) * b.size/n)

FlatLayout is the arithmetic; GroupBuffer holds the buffers of the parameters reduced over one
group and starts each bucket's collective (which one, by ZeRO stage, is ddp.py's story).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..runtime import comm, comm_async


@dataclasses.dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    start: int            # first element in the flat buffer
    end: int              # one past the last, padding included
    data_end: int         # one past the last parameter element (end - data_end = padding)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int, n: int) -> tuple[int, int]:
        """[start, end) of rank's 1/n of this bucket, in flat-buffer coordinates."""
        size = self.numel // n
        return self.start + rank * size, self.start + (rank + 1) * size


class FlatLayout:
    """Where each parameter lives in a flat buffer, and how the buffer is cut into buckets.

    `params` are listed in model order; they are laid out in reverse (see the module docstring).
    `bucket_numel=None` puts everything in one bucket. Parameters in `last` get a bucket of
    their own at the end (data_parallel.ddp: a pipeline's tied embedding, summed over the
    embedding group before its data-parallel collective).
    """

    def __init__(self, params: list[nn.Parameter], bucket_numel: int | None = None, pad_to: int = 1,
                 last: list[nn.Parameter] = ()):
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1 (or None for one bucket), got {bucket_numel}")
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        self.params = list(params)
        self.pad_to = pad_to
        self.offset: dict[nn.Parameter, int] = {}
        self.bucket_of: dict[nn.Parameter, int] = {}
        self.buckets: list[Bucket] = []
        start = cursor = 0
        members: list[nn.Parameter] = []
        late = [p for p in self.params if any(p is q for q in last)]
        for p in [p for p in reversed(self.params) if not any(p is q for q in late)]:
            self.offset[p] = cursor
            self.bucket_of[p] = len(self.buckets)
            cursor += p.numel()
            members.append(p)
            if bucket_numel is not None and cursor - start >= bucket_numel:
                start = cursor = self._close(members, start, cursor)
                members = []
        if members:
            start = cursor = self._close(members, start, cursor)
        for p in late:                      # `last`: a bucket of their own, after all the others
            self.offset[p] = cursor
            self.bucket_of[p] = len(self.buckets)
            cursor += p.numel()
        if late:
            cursor = self._close(late, start, cursor)
        self.numel = cursor

    def _close(self, members: list[nn.Parameter], start: int, data_end: int) -> int:
        end = start + -(-(data_end - start) // self.pad_to) * self.pad_to
        self.buckets.append(Bucket(len(self.buckets), members, start, end, data_end))
        return end

    @property
    def data_numel(self) -> int:
        """Parameter elements, padding excluded (the model's parameter count, Ψ)."""
        return sum(p.numel() for p in self.params)

    def view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """The piece of `flat` that holds `p`, shaped like `p`."""
        o = self.offset[p]
        return flat[o:o + p.numel()].view_as(p)

    def owned(self, rank: int, n: int) -> list[tuple[int, int]]:
        """rank's [start, end) ranges of the flat buffer, one per bucket, in bucket order."""
        return [b.shard(rank, n) for b in self.buckets]

    def pieces(self, p: nn.Parameter, ranges: list[tuple[int, int]]):
        """Where `p` meets `ranges`: (index into p.view(-1), index into the concatenated ranges,
        length) for each overlap. Used to find a parameter's elements inside a shard."""
        lo, hi = self.offset[p], self.offset[p] + p.numel()
        out, packed = [], 0
        for a, b in ranges:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append((s - lo, packed + s - a, e - s))
            packed += b - a
        return out


def flatten_into(layout: FlatLayout, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat buffer holding the parameters' current values; each parameter's data then becomes
    its view of it (so the model reads and the optimizer writes one storage)."""
    flat = torch.zeros(layout.numel, dtype=dtype, device=device)
    with torch.no_grad():
        for p in layout.params:
            view = layout.view(flat, p)
            view.copy_(p.detach())
            p.data = view
    return flat


class GroupBuffer:
    """The parameters whose gradients are summed over one group (data_parallel.ddp): their
    flat parameter buffer, their flat gradient buffer (stages 0-1) or gradient shard (stage 2),
    and each bucket's collective in flight."""

    def __init__(self, params, group, stage: int, scale: float, bucket_numel: int | None):
        self.group, self.stage, self.scale = group, stage, scale
        n, r = group.size, group.rank
        self.shared = [p for p in params if getattr(p, "shared_embedding", False)]
        self.layout = FlatLayout(params, bucket_numel, pad_to=n if stage >= 1 else 1, last=self.shared)
        self.late_bucket = len(self.layout.buckets) - 1 if self.shared else None
        first = params[0]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"the parameters share one flat buffer, so they need one dtype and "
                             f"device; got {sorted(map(str, kinds))}: convert the model first "
                             "(model.to(dtype)) and build DataParallel afterwards")
        self.params_flat = flatten_into(self.layout, first.dtype, first.device)
        buckets = self.layout.buckets
        self.owned = self.layout.owned(r, n) if stage >= 1 else [(b.start, b.end) for b in buckets]
        self.grads_flat = self.grad_shard = None
        self.stamp_finish = False
        self.grad_views: dict[nn.Parameter, torch.Tensor] = {}   # stages 0/1: p's piece of grads_flat
        if stage < 2:
            self.grads_flat = torch.zeros_like(self.params_flat)
            for p in params:     # made once: the hooks run every step, a view costs 3 tensor ops
                p.grad = self.grad_views[p] = self.layout.view(self.grads_flat, p)
        else:
            self.grad_shard = torch.zeros(sum(e - s for s, e in self.owned), dtype=first.dtype,
                                          device=first.device)
        self.reset()

    def reset(self) -> None:
        self.ready = [0] * len(self.layout.buckets)
        self.pending: list = [None] * len(self.layout.buckets)
        self.next_launch = 0
        self.prescaled: set[nn.Parameter] = set()   # views already holding scale x gradient

    # ---- the kept (reduced) gradient of each owned element ----------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        if self.stage == 2:
            return list(self.grad_shard.split([e - s for s, e in self.owned]))
        return [self.grads_flat[s:e] for s, e in self.owned]

    def owned_params(self) -> list[torch.Tensor]:
        return [self.params_flat[s:e] for s, e in self.owned]

    def grad_pieces(self, p: nn.Parameter) -> list[tuple[int, torch.Tensor]]:
        """(index into p.view(-1), 1-D view) for each piece of p's gradient this rank keeps."""
        if self.stage == 0:
            return [(0, self.grad_views[p].view(-1))]
        o = self.layout.offset[p]
        store = self.grad_shard if self.stage == 2 else None
        return [(i, store[j:j + ln] if store is not None else self.grads_flat[o + i:o + i + ln])
                for i, j, ln in self.layout.pieces(p, self.owned)]

    # ---- buckets ---------------------------------------------------------------------
    def adopt_grad(self, p: nn.Parameter, final: bool = False) -> None:
        """Stages 0/1, from p's gradient hook: make p.grad its buffer view. A step's first
        gradient arrives in autograd's own tensor (DataParallel.zero_grad leaves .grad None,
        so autograd hands over what it computed instead of adding it to zeros: one pass over
        the gradients fewer); it is copied in, and later micro-batches add into the view.
        `final` (the backward that sends it): the copy also multiplies by 1/n, so launch has
        no pass of its own to make over this piece (DDP's mul_out; the same multiply, so the
        same bits)."""
        view = self.grad_views[p]
        if p.grad is None:
            # Nothing accumulated yet: a zero-bubble B calls the hook of a weight whose gradient
            # its deferred W will add later (tensor_parallel/weight_grad.py). The view still holds
            # last step's gradient: zero it, or the W adds onto that.
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            if final and self.scale != 1.0:
                torch.mul(p.grad, self.scale, out=view)
                self.prescaled.add(p)
            else:
                view.copy_(p.grad)
            p.grad = view

    def fill_missing(self, b: int) -> None:
        """Stages 0/1, before bucket b is reduced: a parameter that got no gradient this step
        (its .grad still None) must send zeros, not what its view held last step."""
        if self.stage >= 2:
            return
        for p in self.layout.buckets[b].params:
            if p.grad is None:
                p.grad = self.grad_views[p].zero_()

    def sum_shared(self, group) -> None:
        """A pipeline's tied embedding: add the other stage's copy's gradient (before averaging
        over dp, so both stages' copies are reduced alike whatever ZeRO keeps of them)."""
        grads = [self.grad_views[p] if self.stage < 2 else p.grad for p in self.shared]
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.shared)]
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
        offset = 0
        for p, g in zip(self.shared, grads):
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            if self.stage == 2:
                p.grad = g
            offset += g.numel()

    def launch(self, b: int) -> None:
        """Start bucket b's collective (its finish stamped by the backend's own thread only if
        `stamp_finish`: comm_async.Pending; DataParallel sets it)."""
        bucket = self.layout.buckets[b]
        averaged = self.scale != 1.0          # one replica: nothing to average, skip the pass
        if self.stage < 2:
            data = self.grads_flat[bucket.start:bucket.end]
            left = [p for p in bucket.params if p not in self.prescaled]   # adopt_grad did the rest
            if averaged and len(left) == len(bucket.params):
                data.mul_(self.scale)             # one pass (padding included: zeros stay zeros)
            elif averaged:
                for p in left:
                    self.grad_views[p].mul_(self.scale)
        else:   # copy the bucket out of .grad (scaled on the way), free .grad: only the shard stays
            data = torch.zeros(bucket.numel, dtype=self.params_flat.dtype, device=self.params_flat.device)
            for p in bucket.params:
                if p.grad is not None:
                    o = self.layout.offset[p] - bucket.start
                    torch.mul(p.grad.reshape(-1), self.scale, out=data[o:o + p.numel()])
                p.grad = None
        if self.stage == 0:
            self.pending[b] = comm_async.all_reduce(data, self.group, stamp=self.stamp_finish)
        else:
            self.pending[b] = comm_async.reduce_scatter(data, self.group, stamp=self.stamp_finish)

    def land(self, b: int) -> None:
        """Wait for bucket b; ZeRO: put this rank's reduced 1/n where its optimizer reads it."""
        result = self.pending[b].wait()
        if self.stage >= 1:
            kept = self.owned_grads()[b]
            if kept.data_ptr() != result.data_ptr():   # n = 1, stage 1: already in place
                kept.copy_(result)
