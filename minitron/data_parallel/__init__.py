"""Data parallelism and ZeRO: replicas that average gradients, then shard what they replicate.

    engine_api.py  GradientEngine: what both engines below offer, named once
    buffer.py      the flat parameter/gradient buffer, its buckets and their collectives
    ddp.py         DataParallel: bucketed all-reduce (or reduce-scatter) started from backward hooks
    zero.py        ZeroOptimizer: AdamW on fp32 master shards (the ZeRO table is in its docstring)
    zero3.py       ZeroStage3: sharded parameters, gathered unit by unit (pipelines, B/W split too)
    zero3_units.py which parameters form a ZeRO-3 unit (experts, tied embeddings apart)
    zero3_shard.py one unit's flat shard: gathered, freed, its gradients reduce-scattered
    memory.py      per-rank bytes measured, and the ZeRO formulas for memory and traffic
    checks.py      whole tensors rebuilt from shards, for comparisons with the reference

One training step (every rank runs it; minitron.data_parallel.precision has the mixed-precision
parts; minitron.train.engine.TrainingRun puts these together for any grid):

    model = ParallelGPT(cfg, grid).to(torch.bfloat16)       # 16-bit weights, before wrapping
    engine = DataParallel(model, grid, zero_stage=1)        # 0, 1, 2; or ZeroStage3(model, grid)
    opt = ZeroOptimizer(engine, lr=3e-4, weight_decay=0.1)  # fp32 masters of this rank's shard
    scaler = LossScaler()                                   # fp16 only; bf16 needs none
    for step, (tokens, targets) in enumerate(batches):      # the global batch, on every rank
        forward_backward(model, None, tokens, targets, step, engine=engine, microbatches=4,
                         loss_scale=scaler.scale)           # train/step.py: this rank's rows,
                                                            # no_sync but last, finish_grad_sync
        optimizer_step(opt, engine, grid, scaler, max_norm=1.0)   # skip on inf, unscale, clip
        engine.zero_grad()
"""
from .buffer import Bucket, FlatLayout, GroupBuffer
from .checks import gathered_grads, gathered_masters, gathered_params, load_grads, master_pieces
from .ddp import DEFAULT_BUCKET_NUMEL, DataParallel, reduction_group
from .engine_api import GradientEngine
from .memory import StateBytes, formula_bytes, hsdp_wire_bytes, measure, traffic_wire_bytes
from .zero import ZeroOptimizer
from .zero3 import ZeroStage3, default_units


def wrap(model, grid, zero_stage: int = 0, bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
         **adamw) -> tuple[GradientEngine, ZeroOptimizer]:
    """(engine, optimizer) for ZeRO stage 0 (plain data parallel), 1, 2 or 3; `adamw` goes to
    ZeroOptimizer (lr, betas, eps, weight_decay). bucket_numel is unused by stage 3 (one
    collective per unit)."""
    if zero_stage == 3:
        engine = ZeroStage3(model, grid)
    else:
        engine = DataParallel(model, grid, bucket_numel=bucket_numel, zero_stage=zero_stage)
    return engine, ZeroOptimizer(engine, **adamw)


__all__ = ["Bucket", "FlatLayout", "GroupBuffer", "GradientEngine", "DataParallel",
           "DEFAULT_BUCKET_NUMEL", "reduction_group", "ZeroOptimizer", "ZeroStage3", "default_units", "StateBytes",
           "formula_bytes", "hsdp_wire_bytes", "measure", "traffic_wire_bytes", "gathered_grads", "gathered_params",
           "gathered_masters", "master_pieces",
           "load_grads", "wrap"]
