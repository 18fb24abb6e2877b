"""Data parallelism: every rank a replica, gradients averaged in buckets while backward runs.

    ddp = DataParallel(model, grid, bucket_numel=..., zero_stage=0)   # 0: plain, 1/2: ZeRO
    opt = ZeroOptimizer(ddp, lr=...)                                  # minitron.data_parallel.zero
    ddp.zero_grad()
    for i, (tokens, targets) in enumerate(micro_batches):             # this rank's rows only
        with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (model(tokens, targets)[1] / len(micro_batches)).backward()
    ddp.finish_grad_sync()        # instead of model.finalize_grads(): it does the SP sum too
    opt.step()

How a gradient travels. Every parameter's `.grad` is a view of one flat gradient buffer
(buffer.py), cut into buckets. A hook fires when autograd has accumulated a parameter's
gradient; when the last gradient of a bucket is in, the bucket's collective *starts*
(comm_async) and backward carries on computing earlier layers: communication overlaps
computation. `finish_grad_sync` starts whatever is left and waits for everything.
Buckets start strictly in order (0, 1, ...), so every rank issues the same collectives in the
same order, as gloo and NCCL require.

What the collective is, by `zero_stage`:
  0  all-reduce the bucket: every rank holds the whole averaged gradient (plain DP).
  1  reduce-scatter the bucket: rank r keeps only its 1/n, which is all its optimizer shard
     needs (ZeRO-1, Megatron's distributed optimizer); the full buffer stays allocated.
  2  the same reduce-scatter, but the full gradients are not kept: each bucket is copied out of
     the parameters' .grad, sent, and freed; only the 1/n shard stays (ZeRO-2). Under
     no_sync the full gradients wait in .grad until the last micro-batch.
Same wire bytes in all three: a ring all-reduce IS a reduce-scatter followed by an all-gather,
and stages 1 and 2 all-gather the updated parameters instead of the gradients.

Averaging. The loss on each rank is the mean over its own tokens, so the global loss is the
mean of the ranks' losses and its gradient the mean of theirs: sum, then divide by the number
of replicas that saw different data. gloo has no AVG, so each bucket is multiplied by 1/n
before its collective (as Megatron does). Dense parameters are summed over `dense_dp`
(dp x cp x ep: all see different tokens); expert parameters (marked `allreduce = False`, as
in Megatron) over `dp_cp`, the ranks that hold the same expert, but divided by the same
dense_dp size: the tokens of every expert-parallel rank already reached the expert through
the all-to-all, so the sum over dp_cp covers all dense_dp ranks' data.

Hybrid sharding (HSDP, grid.dp_shard < dp): stages 1 and 2 reduce-scatter each bucket and
all-gather the weights inside the shard group only (dense_dp_shard, or dp_cp_shard for
experts: dp_shard ranks, neighbours), then all-reduce the 1/dp_shard they keep across the
dp_replicate copies of that shard: the only collective that leaves the shard group, and it
carries 1/dp_shard of the gradient (data_parallel/memory.py has the bytes per group).

Gradient accumulation: inside `no_sync()` the hooks only move each first gradient into the
buffer, gradients add up there, and only the last micro-batch's backward communicates (once
per bucket).

A pipeline's tied embedding (the first stage's table, reused as the last stage's output layer;
both copies marked `shared_embedding = True`) gets a bucket of its own, started last, by
finish_grad_sync: its gradient is first summed over the `embedding` group (the two stages),
then averaged like any other. Summing before the data-parallel collective keeps it right under
ZeRO, where the two stages' ranks keep different pieces of their buffers.

Overlap, measured: each collective records when it started and finished (comm_async), so
`comm_events()` is a timeline (pipeline/actions.py's Event) and `hidden_fraction()` the share
of communication time that ran before backward ended. The finish is, by default, the first
moment this rank saw the collective done: each gradient hook asks the oldest unfinished one
(Pending.poll), the end of backward asks all, and waiting stamps the rest as it returns; an
upper bound, late by up to the gap between two such moments. `exact_timeline = True` has
gloo's own thread stamp it as it completes instead: a Python callback per collective, the GIL
handed from the training thread to gloo's and back each time, which cost about 1.4% of the
step's CPU time (both ranks) at 1 MB buckets, measured beside torch's DDP with the same engine
toggled; DDP keeps no timeline at all.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from .. import refusals
from ..runtime import comm, comm_async
from ..grid import Grid
from ..pipeline.actions import Event
from .buffer import GroupBuffer
from .engine_api import GradientEngine, Piece

DEFAULT_BUCKET_NUMEL = 40_000_000   # Megatron's default bucket size, in elements


def reduction_group(p: nn.Parameter, grid: Grid):
    """The group a parameter's gradient is summed (and ZeRO-sharded) over (module docstring);
    with HSDP its shard group, the sum completed across grid.dp_replicate."""
    return grid.dp_cp_shard if getattr(p, "allreduce", True) is False else grid.dense_dp_shard


def sum_sequence_parallel_grads(engine: GradientEngine, grid: Grid) -> None:
    """Under sequence parallelism, sum the gradients of parameters marked `sequence_parallel`
    over tp (tensor_parallel/grads.py explains why), on the pieces `engine` keeps: under ZeRO
    only the owned shard is summed, which is all the optimizer reads. One all-reduce."""
    if not grid.sequence_parallel or grid.tp.size == 1:
        return
    pieces = [t for p in engine.parameters if getattr(p, "sequence_parallel", False)
              for _, t in engine.grad_pieces(p)]
    if not pieces:
        return
    flat = comm.all_reduce(torch.cat(pieces), grid.tp)
    offset = 0
    for t in pieces:
        t.copy_(flat[offset:offset + t.numel()])
        offset += t.numel()


class DataParallel(GradientEngine):
    """Bucketed, overlapped gradient averaging for `model` over the grid's data-parallel groups.

    `bucket_numel`: elements per bucket (None: one bucket). `zero_stage`: 0, 1 or 2 (see the
    module docstring); stage 3 is minitron.data_parallel.zero3.ZeroStage3. Parameters are moved
    into one flat buffer (their .data become views of it); build optimizers afterwards.
    """

    def __init__(self, model: nn.Module, grid: Grid, *, bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
                 zero_stage: int = 0):
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"DataParallel handles zero_stage 0, 1 or 2, got {zero_stage!r}; "
                             "stage 3 shards the parameters too: use ZeroStage3")
        refusals.check(refusals.Options(dp=grid.config.dp, dp_shard=grid.config.dp_shard,
                                        zero=zero_stage), "engine")     # HSDP needs a ZeRO stage
        self.model, self.grid, self.zero_stage = model, grid, zero_stage
        self.replicas = grid.dp_replicate
        self.names = {p: n for n, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        by_group: dict[str, tuple] = {}
        for p in params:
            g = reduction_group(p, grid)
            by_group.setdefault(g.name, (g, []))[1].append(p)
        scale = 1.0 / grid.dense_dp.size
        self.buffers = [GroupBuffer(ps, g, zero_stage, scale, bucket_numel)
                        for g, ps in by_group.values()]
        self.buffer_of = {p: gb for gb in self.buffers for p in gb.layout.params}
        # what the hook needs of each parameter, found once: (its buffer, its bucket, whether
        # that bucket is the late one that finish_grad_sync starts)
        self._slot = {p: (gb, gb.layout.bucket_of[p], gb.layout.bucket_of[p] == gb.late_bucket)
                      for gb in self.buffers for p in gb.layout.params}
        self.sync_enabled = True
        self.events: list[tuple[str, object, float]] = []   # (what, bucket or name, time): the overlap
        self.collectives: list[tuple[int, comm_async.Pending]] = []   # (bucket, its collective)
        self._unstamped = 0        # collectives[:_unstamped] have their finish stamped
        self.backward_end: float | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    @property
    def exact_timeline(self) -> bool:
        """Whether gloo's thread stamps each collective's finish (module docstring); off: polled."""
        return all(gb.stamp_finish for gb in self.buffers)

    @exact_timeline.setter
    def exact_timeline(self, on: bool) -> None:
        for gb in self.buffers:
            gb.stamp_finish = bool(on)

    # ---- GradientEngine (engine_api.py): the training loop ------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (every micro-batch but the last)."""
        before, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = before

    def finish_grad_sync(self) -> None:
        """Start the buckets not yet started, wait for all, then sum the sequence-parallel
        parameters' gradients over tp (what model.finalize_grads does, on the kept pieces)."""
        self.backward_end = time.perf_counter()
        for _, pending in self.collectives:   # those done by now finished inside backward
            pending.poll()
        for gb in self.buffers:
            while gb.next_launch < len(gb.layout.buckets):
                self._launch(gb, gb.next_launch)
            for b in range(len(gb.layout.buckets)):
                gb.land(b)
                if self.zero_stage >= 1:
                    self.sync_replicas(gb.owned_grads()[b])
                self.events.append(("landed", b, time.perf_counter()))
            gb.reset()
        sum_sequence_parallel_grads(self, self.grid)

    def sync_replicas(self, shard: torch.Tensor) -> None:
        """HSDP: sum a reduced gradient shard across the copies of this shard (in place)."""
        comm.all_reduce(shard, self.replicas)

    def zero_grad(self) -> None:
        """Start a step. .grad becomes None, not a zeroed view: the first gradient is copied
        into the buffer by the hook (buffer.adopt_grad), and a parameter that gets none is
        zeroed before its bucket is sent (buffer.fill_missing)."""
        for gb in self.buffers:
            if gb.grad_shard is not None:
                gb.grad_shard.zero_()
            for p in gb.layout.params:
                p.grad = None
        self.events.clear()
        self.collectives.clear()
        self._unstamped = 0

    # ---- what the optimizer (zero.py) and the checks read ---------------------------
    def owned_params(self) -> list[torch.Tensor]:
        return [t for gb in self.buffers for t in gb.owned_params()]

    def owned_grads(self) -> list[torch.Tensor]:
        return [t for gb in self.buffers for t in gb.owned_grads()]

    def group_of(self, p: nn.Parameter) -> comm.Group:
        return self.buffer_of[p].group

    def grad_pieces(self, p: nn.Parameter) -> list[Piece]:
        return self.buffer_of[p].grad_pieces(p)

    @property
    def parameters(self) -> list[nn.Parameter]:
        return list(self.buffer_of)

    @property
    def grads_replicated(self) -> bool:
        """Plain DP: every rank holds every gradient (a norm must count one rank's)."""
        return self.zero_stage == 0

    def after_step(self) -> None:
        """ZeRO 1/2: each rank updated its 1/n of the parameters; all-gather them, bucket by bucket."""
        if self.zero_stage == 0:
            return
        for gb in self.buffers:
            if gb.group.size == 1:
                continue                      # this rank updated everything itself
            for b, (s, e) in zip(gb.layout.buckets, gb.owned):
                pending = comm_async.all_gather(gb.params_flat[s:e].clone(), gb.group,
                                                out=gb.params_flat[b.start:b.end], stamp=False)
                pending.wait()

    def param_tensors(self) -> list[torch.Tensor]:
        return [gb.params_flat for gb in self.buffers]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [gb.grads_flat if gb.grads_flat is not None else gb.grad_shard for gb in self.buffers]

    @property
    def padded_numel(self) -> int:
        return sum(gb.layout.numel for gb in self.buffers)

    # ---- the measured overlap of the last step --------------------------------------
    def comm_events(self) -> list[Event]:
        """The bucket collectives since zero_grad, as timeline Events (pipeline/actions.py):
        kind = the collective, stage = the bucket, start/end in time.perf_counter() seconds."""
        return [Event(self.grid.rank, pending.op, 0, b, pending.started, pending.finished)
                for b, pending in self.collectives if pending.finished is not None]

    def hidden_fraction(self) -> float:
        """The share of the collectives' time that ran while backward was still running (before
        finish_grad_sync was called): 1.0 is perfect overlap, 0.0 none."""
        events = self.comm_events()
        total = sum(e.end - e.start for e in events)
        if total == 0 or self.backward_end is None:
            return 0.0
        hidden = sum(max(0.0, min(e.end, self.backward_end) - e.start) for e in events)
        return hidden / total

    # ---- hooks -----------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        gb, b, late = self._slot[p]
        if self.zero_stage < 2:
            gb.adopt_grad(p, final=self.sync_enabled and not late)
        if not self.sync_enabled:
            return
        self.events.append(("grad", self.names[p], time.perf_counter()))
        # stamp finished collectives (oldest first: gloo completes them in order) as we go
        while self._unstamped < len(self.collectives) and self.collectives[self._unstamped][1].poll():
            self._unstamped += 1
        if late:
            return                            # started by finish_grad_sync, after sum_shared
        gb.ready[b] += 1
        buckets = gb.layout.buckets
        while gb.next_launch < len(buckets) and gb.ready[gb.next_launch] == len(buckets[gb.next_launch].params):
            self._launch(gb, gb.next_launch)

    def _launch(self, gb: GroupBuffer, b: int) -> None:
        gb.fill_missing(b)
        if b == gb.late_bucket:
            gb.sum_shared(self.grid.embedding)
        self.events.append(("launch", b, time.perf_counter()))
        gb.launch(b)
        self.collectives.append((b, gb.pending[b]))
        gb.next_launch = b + 1

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
