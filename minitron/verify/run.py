"""verify(): launch the ranks of one configuration and compare both sides (see the package's docstring)."""
from __future__ import annotations

import dataclasses

import torch

from .. import refusals
from ..grid import ParallelConfig
from ..model.splits import validate_model
from ..config import ModelConfig, check_adamw
from ..model.fused import enable_kernels
from ..model.reference import GPT
from ..runtime.launch import DEFAULT_TIMEOUT, launch, ranks_will_build_optimizers
from ..tensor_parallel.fp8_blocks import fit_block, split_pieces
from ..train.engine import check_supported, resolve_schedule
from .checks import Report
from .plants import Plant
from .steps import run_rank


def verify(parallel_config: ParallelConfig, model_config: ModelConfig, steps: int = 3, *,
           dtype: torch.dtype = torch.float32, seed: int = 0, lr: float = 1e-4, eps: float = 1e-6,
           batch: int | None = None, seq: int | None = None, timeout: float = DEFAULT_TIMEOUT,
           plant: str | None = None, schedule: str | None = None,
           microbatches: int | None = None, zero: int | None = None,
           reference_routing: bool | None = None, fp8=None) -> Report:
    """Launch parallel_config.world_size ranks, compare for `steps` AdamW steps, return the report.

    With pp > 1, virtual_pp > 1 or a `schedule` name (pipeline.schedules.SCHEDULES) the model
    is cut into pipeline stages and run by the pipeline executor (train.engine.resolve_schedule);
    `batch` defaults to one sample per micro-batch (2 without a pipeline), per dp replica.
    `zero` (0-3; dp > 1 and 16-bit dtypes too) steps through a data-parallel engine.
    With model_config.use_kernels this process's environment may get TRITON_INTERPRET=1
    (see enable_kernels). `reference_routing`: the split model's routers take the reference's
    (token, expert) choices, so a 16-bit rounding flip of a top-k does not end the comparison
    (verify/routing.py); None (the default): on in 16 bits and FP8 with experts, off otherwise.
    (see enable_kernels). fp8: an FP8Recipe, with dtype=torch.bfloat16 (train.precision.
    resolve_precision): the split model's block GEMMs in FP8, against the float32 reference.
    """
    check_adamw(lr, eps)
    sched = resolve_schedule(parallel_config, schedule, microbatches)
    if sched is not None:     # ZB-V has two chunks per rank whatever virtual_pp says
        parallel_config = dataclasses.replace(parallel_config, virtual_pp=sched.virtual)
    batch = split_batch(batch, parallel_config, sched, "a batch of")
    check_supported(parallel_config, model_config, dtype, zero, sched, fp8)   # a bad ZeRO stage
    check_comparable(parallel_config, model_config, dtype, zero, sched, fp8, bool(reference_routing))
    if steps < 1 or batch < 1:
        raise ValueError(f"verify needs steps >= 1 and batch >= 1, got steps={steps}, batch={batch}")
    seq = seq or model_config.seq_len
    validate_model(parallel_config, model_config, seq)
    fp8 = verify_recipe(fp8, parallel_config, model_config, batch, sched, seq)
    # an unknown plant, or one whose target no parameter has, fails here, not in a rank
    Plant(plant).check_fp8(fp8).resolve(GPT(model_config, seed))
    if model_config.use_kernels:
        enable_kernels(model_config, parallel_config.world_size)
    ranks_will_build_optimizers()
    rows = launch(run_rank, parallel_config, model_config, steps, dtype, seed, lr, eps, batch, seq,
                  plant, sched, zero, reference_routing, fp8, world_size=parallel_config.world_size,
                  timeout=timeout)[0]
    return Report(rows)


def check_comparable(pcfg: ParallelConfig, mcfg: ModelConfig, dtype: torch.dtype, zero, sched,
                     fp8=None, reference_routing: bool = False) -> None:
    """What verify refuses: the engine's refusals and what it runs but verify cannot compare
    with one device (minitron/refusals/, every level; Refused)."""
    refusals.check(refusals.Options.of(pcfg, mcfg, dtype, zero, sched, fp8, reference_routing))


def verify_recipe(fp8, pcfg: ParallelConfig, mcfg: ModelConfig, batch: int, sched,
                  seq: int | None = None):
    """A fine-grained FP8 recipe with blocks no split cuts (tensor_parallel/fp8_blocks.py): the
    split's casts are then one device's; the others as they are."""
    if fp8 is None or not fp8.fine_grained:
        return fp8
    rows = batch // (pcfg.dp * pcfg.ep * (sched.microbatches if sched is not None else 1))
    return fit_block(fp8, split_pieces(pcfg, mcfg, rows, seq or mcfg.seq_len))


def split_batch(batch: int | None, pcfg: ParallelConfig, sched, what: str) -> int:
    """The batch (default: one sequence per micro-batch, else 2, per dp replica; with ep, one
    row per dp x ep replica at least), checked to cut into the replicas' whole micro-batches."""
    per_replica = sched.microbatches if sched is not None else 1
    replicas = pcfg.dp * pcfg.ep          # expert-parallel ranks run their own rows too
    batch = batch or (per_replica * replicas if sched is not None else max(2 * pcfg.dp, replicas))
    if batch % (per_replica * replicas) == 0:
        return batch
    if replicas == 1:
        raise ValueError(f"{what} {batch} cannot be cut into {per_replica} equal "
                         f"micro-batches: use a multiple of {per_replica}")
    who = f"dp={pcfg.dp}" if pcfg.ep == 1 else f"dp x ep={replicas}"
    raise ValueError(f"{what} {batch} cannot be cut into {who} replicas of {per_replica} "
                     f"micro-batch(es): use a multiple of {replicas * per_replica}")
