"""One data-parallel forward/backward: this rank's rows of the global batch, in micro-batches.

The global batch of B rows is cut into n = dp x ep equal parts (expert-parallel ranks are data-
parallel replicas for the dense layers); replica d takes rows [d*B/n, (d+1)*B/n), and cuts them
again into micro-batches. Every micro-batch but the last runs under `engine.no_sync()`, so
gradients add up locally and each bucket is sent once. Each micro-batch's loss is divided by
the number of micro-batches: the rank's loss is then the mean over all its tokens, and the
engine's 1/dense_dp makes the gradient the global mean's.

Dropout masks are keyed by the global batch row (tensor_parallel/random.py), so telling the
RNG where this micro-batch starts (`rows_from`) gives it the reference's masks.
"""
from __future__ import annotations

import contextlib

import torch

from ..grid import Grid
from .engine_api import GradientEngine


def local_rows(global_batch: int, grid: Grid) -> slice:
    """This rank's rows of the global batch. Rows are split over the replicas that see different
    sequences, dp x ep (with cp = 1 that is dense_dp, in its rank order); context-parallel ranks
    share their rows and split each sequence instead (context_parallel/)."""
    ep, dp = grid.config.ep, grid.config.dp
    n, d = ep * dp, grid.coords["ep"] + ep * grid.coords["dp"]
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} is not divisible by the {n} data-parallel "
                         f"replicas (dp x ep): use a multiple of {n}")
    b = global_batch // n
    return slice(d * b, (d + 1) * b)


def forward_backward(model, engine: GradientEngine, tokens: torch.Tensor, targets: torch.Tensor, *,
                     micro_batches: int = 1, step_seed: int | None = None,
                     loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward this rank's rows of (tokens, targets), the global batch; returns
    the loss (mean over this rank's tokens, unscaled). Call engine.finish_grad_sync() after.

    `loss_scale` multiplies the loss before backward (fp16 loss scaling, minitron.data_parallel.precision)."""
    rows = local_rows(tokens.shape[0], engine.grid)
    b = rows.stop - rows.start
    if b % micro_batches:
        raise ValueError(f"{b} rows per rank do not split into {micro_batches} micro-batches: "
                         f"choose a divisor of {b}")
    mb = b // micro_batches
    total = torch.zeros((), dtype=torch.float32, device=tokens.device)
    for m in range(micro_batches):
        first = rows.start + m * mb
        last = m == micro_batches - 1
        quiet = engine.no_sync() if not last else contextlib.nullcontext()
        with quiet:
            rng = getattr(model, "rng", None)
            if rng is not None and step_seed is not None:
                rng.reset(step_seed)
                if hasattr(rng, "rows_from"):
                    rng.rows_from(first)
            _, loss = model(tokens[first:first + mb], targets[first:first + mb])
            (loss * (loss_scale / micro_batches)).backward()
        total += loss.detach().float() / micro_batches
    return total
