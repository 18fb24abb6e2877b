"""The data-parallel plants (plants.py), put into the engine once it is built: dp-bucket (a
bucket never all-reduced), zero-gather (ZeRO's updated shards never all-gathered) and
hsdp-no-replicate (the shards never all-reduced across replicas)."""
from __future__ import annotations

import torch

from ..data_parallel.zero3 import ZeroStage3
from ..runtime.comm_async import Pending


def plant_engine(kind: str, engine) -> None:
    """Patch `engine` (minitron.data_parallel) with the data-parallel plant `kind`, if it is one."""
    if kind == "dp-bucket":
        _never_reduce_bucket(engine, 1)
    elif kind == "hsdp-no-replicate":
        if engine.replicas.size == 1:
            raise ValueError("plant hsdp-no-replicate skips the all-reduce across replicas: "
                             "needs --dp-shard below --dp (and --zero 1, 2 or 3)")
        engine.sync_replicas = lambda shard: None
    elif kind == "zero-gather":
        if isinstance(engine, ZeroStage3):
            for unit in engine.units:
                unit.gather = _stale_gather(unit)
        elif engine.zero_stage not in (1, 2):
            raise ValueError("plant zero-gather skips ZeRO's all-gather of updated weights: "
                             "use --zero 1, 2 or 3")
        else:
            engine.after_step = lambda: None


def _stale_gather(unit):
    """unit.gather that keeps its first result but for this rank's own shard (zero-gather)."""
    real, first = unit.gather, []

    @torch.no_grad()
    def gather():
        if unit.gathered:
            return
        real()
        if not first:
            first.append(unit.full.clone())
        lo, hi = unit.range
        unit.full.copy_(first[0])
        unit.full[lo:hi].copy_(unit.shard)
    return gather


def _never_reduce_bucket(engine, b: int) -> None:
    """Bucket b's all-reduce is replaced by nothing: its gradients stay this rank's (times 1/dp)."""
    gb = engine.buffers[0]
    if getattr(engine, "zero_stage", 3) != 0 or len(gb.layout.buckets) <= b:
        raise ValueError(f"plant dp-bucket needs plain data parallelism (--zero 0) and more than {b} "
                         f"buckets")
    launch = gb.launch

    def launch_all_but_b(k: int) -> None:
        if k != b:
            return launch(k)
        bucket = gb.layout.buckets[k]
        data = gb.grads_flat[bucket.start:bucket.end].mul_(gb.scale)
        gb.pending[k] = Pending("all_reduce", gb.group, None, data)   # done at once: nothing sent
    gb.launch = launch_all_but_b
