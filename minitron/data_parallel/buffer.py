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
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn


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
    `bucket_numel=None` puts everything in one bucket.
    """

    def __init__(self, params: list[nn.Parameter], bucket_numel: int | None = None, pad_to: int = 1):
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
        for p in reversed(self.params):
            self.offset[p] = cursor
            self.bucket_of[p] = len(self.buckets)
            cursor += p.numel()
            members.append(p)
            if bucket_numel is not None and cursor - start >= bucket_numel:
                start = cursor = self._close(members, start, cursor)
                members = []
        if members:
            cursor = self._close(members, start, cursor)
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
