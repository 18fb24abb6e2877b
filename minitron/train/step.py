"""One forward and backward of the split model, for every configuration the engine runs.

    x, logits, loss = parallel_step(model, tokens, targets, step_seed)        # one micro-batch
    out = forward_backward(model, schedule, tokens, targets, step_seed, ...)  # a replica's rows

A step takes one of two shapes, by whether the model is cut into pipeline stages:

  no schedule  the rank holds every layer: each micro-batch is embedded, run and its loss taken
               on this rank (parallel_step), its tokens this cp rank's zigzag chunks of the
               sequences (context_parallel.shard_sequence); every micro-batch but the last
               runs under the data-parallel engine's no_sync, so each bucket is sent once and
               the last micro-batch's communication overlaps its backward.
  a schedule   the pipeline executor runs the schedule's actions (pipeline/executor.py) under
               no_sync; the sync comes back on where the last micro-batch's backward begins,
               so its buckets are reduced while that backward runs.

Either way the gradient fix-ups run once at the end: the engine's finish_grad_sync (its bucket
all-reduces, the sequence-parallel sums over tp, the average over cp, the tied embedding over
the first and last stage), or model.finalize_grads() when there is no engine.

What a verifier plants in a step (a fault that shows a check can fail) comes through `hooks`,
an object with StepHooks' methods; the default plants nothing (verify/plants.py plants faults).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..context_parallel import shard_sequence, unshard_sequence
from ..data_parallel import DataParallel
from ..pipeline.executor import collect_outputs, run_schedule
from ..runtime import comm


class StepHooks:
    """The points of a step where a verifier may plant a fault. Every method does nothing here."""

    def cp_layout(self) -> str:
        return "zigzag"                   # the order the sequences are cut in over cp

    def step(self):
        """Wraps the step's forward and backward: a verifier patches a function inside it."""
        return contextlib.nullcontext()

    def grads(self, model, grid) -> None:
        """After the gradients are final, before anything reads them."""

    def logits(self, full: torch.Tensor) -> torch.Tensor:
        return full


NO_HOOKS = StepHooks()


@dataclasses.dataclass
class StepOutput:
    """What one step gives back. loss: the whole batch's mean (every rank); logits [b, s, V] and
    dx = dL/dX [b, s, h] of the whole batch on every rank when kept (for comparing), else None."""
    loss: torch.Tensor
    logits: torch.Tensor | None = None
    dx: torch.Tensor | None = None


def parallel_step(model, tokens, targets, step_seed: int, *,
                  first_row: int = 0, loss_scale: float = 1.0, finish=None):
    """Forward, loss, backward and the gradient fix-up (`finish`, default model.finalize_grads)
    of one micro-batch on a rank that holds every layer; returns (X, logits shard, loss).
    `first_row`: where `tokens` start in the global batch (dropout masks are keyed by row)."""
    model.rng.reset(step_seed)
    if first_row:
        model.rng.rows_from(first_row)
    x = model.embed(tokens)
    x.retain_grad()                      # dL/dX, X = the input of the first block
    logits = model.output_layer(model.run_layers(x))
    loss = model.loss(logits, targets)
    (loss * loss_scale).backward()       # loss_scale: fp16, and 1/m per micro-batch
    (finish or model.finalize_grads)()
    return x, logits, loss


def replica_rows(batch: int, grid, microbatches: int = 1) -> torch.Tensor:
    """This replica's rows of the global batch, micro-batch by micro-batch (Megatron's
    MegatronPretrainingSampler composes batches this way). The step's micro-batch m is rows
    [m*B/M, (m+1)*B/M) whatever the layout, and the replicas that see different sequences,
    dp x ep (the ranks of grid.ep_dp, in its order), each take one slice of it: replica d of n
    holds rows m*B/M + [d*b, (d+1)*b), b = B/(M*n), as its micro-batch m. So micro-batch m
    holds the same rows on one device as over the replicas (the global balance loss sums its
    token counts over them); with M = 1 replica d holds the d-th n-th of the batch. Returns
    the global row of each of its rows, in its order. Context-parallel ranks share their rows
    and split each sequence instead (context_parallel/). Reads only grid.config and grid.coords."""
    ep, dp = grid.config.ep, grid.config.dp
    n, d = ep * dp, grid.coords["ep"] + ep * grid.coords["dp"]
    if batch % (n * microbatches):
        raise ValueError(f"global batch {batch} is not divisible by the {n} data-parallel "
                         f"replicas (dp x ep) times {microbatches} micro-batches: use a "
                         f"multiple of {n * microbatches}")
    b = batch // (n * microbatches)
    return torch.cat([torch.arange(m * n * b + d * b, m * n * b + (d + 1) * b)
                      for m in range(microbatches)])


def in_row_order(gathered: torch.Tensor, replicas: int, microbatches: int) -> torch.Tensor:
    """Every replica's rows (its replica_rows), replica after replica as an all-gather over
    grid.ep_dp along dim 0 holds them, put back in the global batch's order."""
    b = gathered.shape[0] // (replicas * microbatches)
    return gathered.reshape(replicas, microbatches, b, *gathered.shape[1:]).transpose(0, 1) \
        .reshape(gathered.shape)


def _unpipelined(model, engine, hooks, tokens, targets, step_seed, rows, microbatches,
                 loss_scale, keep):
    """Micro-batches of this replica's rows (`rows`: their global rows) on a rank that holds
    every layer."""
    grid, cp = model.grid, model.grid.cp
    mb, layout = tokens.shape[0] // microbatches, hooks.cp_layout()
    total, kept = torch.zeros((), dtype=torch.float32, device=tokens.device), []
    for m in range(microbatches):
        mine = slice(m * mb, (m + 1) * mb)
        last = m == microbatches - 1
        quiet = engine.no_sync() if engine is not None and not last else contextlib.nullcontext()
        with quiet:
            x, logits, loss = parallel_step(
                model, shard_sequence(tokens[mine], cp.size, cp.rank, layout),
                shard_sequence(targets[mine], cp.size, cp.rank, layout), step_seed,
                first_row=int(rows[m * mb]), loss_scale=loss_scale / microbatches, finish=lambda: None)
        total += loss.detach().float() / microbatches
        if keep:
            kept.append((x, logits.detach()))
    (engine.finish_grad_sync if engine is not None else model.finalize_grads)()
    hooks.grads(model, grid)
    if cp.size > 1:   # a rank's loss is the mean over its tokens: the batch's, averaged over cp
        total = comm.all_reduce(total.clone(), cp) / cp.size
    if not keep:
        return total, None, None
    dx = torch.cat([x.grad for x, _ in kept])   # each of the replica's mean loss (1/m applied)
    logits = comm.all_gather(torch.cat([lg for _, lg in kept]), grid.tp, dim=-1)
    if grid.sequence_parallel:
        dx = comm.all_gather(dx, grid.tp, dim=1)
    if cp.size > 1:
        dx, logits = unshard_sequence(dx, cp) / cp.size, unshard_sequence(logits, cp)
    return total, logits, dx


def _pipelined(model, engine, hooks, schedule, tokens, targets, step_seed, rows, keep):
    """The pipeline executor on this replica's rows, under the engine's no_sync. DataParallel's
    sync comes back on where the rank's last micro-batch's backward begins (Megatron's way; not
    under a B/W split, see executor.last_backward_tail), so its buckets start while that
    backward runs; ZeRO-3 reduce-scatters each micro-batch by
    itself (data_parallel/zero3.py), and finish_grad_sync completes either."""
    model.rng.reset(step_seed)
    quiet = engine.no_sync() if engine is not None else contextlib.nullcontext()
    def resume():
        engine.sync_enabled = True
    with quiet:
        result = run_schedule(schedule, model, tokens, targets, layout=hooks.cp_layout(), rows=rows,
                              keep_outputs=keep, finalize_grads=engine is None,
                              on_last_backward=resume if isinstance(engine, DataParallel) else None)
    if engine is not None:
        engine.finish_grad_sync()
    hooks.grads(model, model.grid)
    if keep:
        logits, loss, dx = collect_outputs(result, model, *tokens.shape)
        return loss, logits, dx
    grid = model.grid
    loss = result.loss.detach().float() if model.holds_last else torch.zeros((), device=grid.device)
    loss = comm.all_reduce(loss.reshape(1).clone(), grid.pp)[0]      # from the last stage
    return loss, None, None


def forward_backward(model, schedule, tokens, targets, step_seed: int, *, engine=None,
                     hooks: StepHooks = NO_HOOKS, microbatches: int = 1, loss_scale: float = 1.0,
                     keep_outputs: bool = False) -> StepOutput:
    """Forward and backward of the global batch (tokens, targets: the same on every rank);
    this rank runs its replica's rows (replica_rows, by the schedule's micro-batches or
    `microbatches`). Returns the batch's mean loss (its logits and dL/dX gathered over the
    replicas too with keep_outputs, in the batch's row order). Each replica's loss is the mean
    over its rows, so the batch's is their mean, and its dL/dX each replica's over their number."""
    grid = model.grid
    m = schedule.microbatches if schedule is not None else microbatches
    rows = replica_rows(tokens.shape[0], grid, m)
    tokens, targets = tokens[rows], targets[rows]
    with hooks.step():
        if schedule is None:
            loss, logits, dx = _unpipelined(model, engine, hooks, tokens, targets, step_seed,
                                            rows, microbatches, loss_scale, keep_outputs)
        else:
            loss, logits, dx = _pipelined(model, engine, hooks, schedule, tokens, targets, step_seed,
                                          rows, keep_outputs)
    replicas = grid.ep_dp      # the ranks that ran other rows (cp is already gathered back)
    n = replicas.size
    if n > 1:
        loss = comm.all_reduce(loss.detach().clone().reshape(1), replicas)[0] / n
        if keep_outputs:
            logits = in_row_order(comm.all_gather(logits.contiguous(), replicas, dim=0), n, m)
            dx = in_row_order(comm.all_gather(dx.contiguous(), replicas, dim=0), n, m) / n
    return StepOutput(loss.detach(), logits, dx)
