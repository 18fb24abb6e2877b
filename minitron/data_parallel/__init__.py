"""Data parallelism and ZeRO: replicas that average gradients, then shard what they replicate.

    buffer.py   the flat parameter/gradient buffer and its buckets
    ddp.py      DataParallel: bucketed all-reduce (or reduce-scatter) started from backward hooks
    step.py     forward_backward: this rank's rows of the global batch, in micro-batches
    zero.py     ZeroOptimizer (AdamW on fp32 master shards) and ZeroStage3 (sharded parameters)
    memory.py   per-rank bytes measured, and the ZeRO formulas for memory and traffic
    checks.py   whole tensors rebuilt from shards, for comparisons with the reference
"""
from .buffer import Bucket, FlatLayout
from .checks import gathered_grads, gathered_params, load_grads
from .ddp import DEFAULT_BUCKET_NUMEL, DataParallel, reduction_group
from .memory import StateBytes, formula_bytes, measure, traffic_wire_bytes
from .zero import ZeroOptimizer, ZeroStage3, default_units


def wrap(model, grid, zero_stage: int = 0, bucket_numel: int | None = DEFAULT_BUCKET_NUMEL, **adamw):
    """(engine, optimizer) for one of ZeRO's stages 0 (plain data parallel) to 3."""
    if zero_stage == 3:
        engine = ZeroStage3(model, grid)
    else:
        engine = DataParallel(model, grid, bucket_numel=bucket_numel, zero_stage=zero_stage)
    return engine, ZeroOptimizer(engine, **adamw)


__all__ = ["Bucket", "FlatLayout", "DataParallel", "DEFAULT_BUCKET_NUMEL", "reduction_group",
           "ZeroOptimizer", "ZeroStage3", "default_units", "StateBytes", "formula_bytes",
           "measure", "traffic_wire_bytes", "gathered_grads", "gathered_params", "load_grads",
           "wrap"]
