"""One step's outputs gathered onto every rank, for comparing a pipeline run with one device."""
from __future__ import annotations

import torch

from ..context_parallel import unshard_sequence
from ..runtime import comm

# `result` is an executor.StepResult and `model` a PipelineGPT (model/stages.py): only named here.


def collect_outputs(result, model, batch: int, seq: int):
    """(logits [b, s, V], loss, dL/dX [b, s, h]) of the whole batch on every rank, for comparing
    with one device: gathered over tp where they are split, the sequence gathered back in order
    over cp, then broadcast over pp from the rank of the stage that made them (collective over
    tp, cp and pp). A cp rank's dL/dX is of its own tokens' mean loss: cp times the batch's."""
    grid, cfg = model.grid, model.cfg
    dtype, device = next(model.parameters()).dtype, grid.device

    def from_stage(stage: int, local, shape, split_dim: int | None, dtype=dtype):
        if local is not None:
            local = torch.cat(local) if isinstance(local, list) else local.reshape(shape)
            if split_dim is not None:
                local = comm.all_gather(local.contiguous(), grid.tp, dim=split_dim)
            if local.dim():                  # the sequence (dim 1), this cp rank's chunks
                local = unshard_sequence(local, grid.cp)
        out = local.contiguous() if local is not None else torch.empty(shape, dtype=dtype, device=device)
        return comm.broadcast(out, grid.pp, src=model.placement[stage])

    last = model.n_stages - 1
    logits = from_stage(last, result.logits, (batch, seq, cfg.vocab_size), -1)
    loss = from_stage(last, result.loss, (), None, torch.float32)   # the loss is float32 (cross_entropy.py)
    dx = from_stage(0, result.input_grads, (batch, seq, cfg.hidden),
                    1 if grid.sequence_parallel else None)
    return logits, loss, dx / grid.cp.size
