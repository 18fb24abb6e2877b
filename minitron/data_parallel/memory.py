"""Per-rank bytes of parameters, gradients and optimizer state: measured, and by formula.

Measured means: the storages actually allocated, each counted once (a parameter that is a view
of a flat buffer is that buffer; a stage-3 parameter whose storage was freed is 0 bytes).

The formulas (ZeRO paper, mixed-precision Adam, Ψ parameters, N data-parallel ranks):

    stage   params   grads    optimizer (fp32 master + 2 moments)
    0       2Ψ       2Ψ       12Ψ
    1       2Ψ       2Ψ       12Ψ/N
    2       2Ψ       2Ψ/N     12Ψ/N
    3       2Ψ/N     2Ψ/N     12Ψ/N

Ψ here is the parameter count after each bucket (stage 3: each unit) is padded to a multiple
of N (`engine.padded_numel`); on a model whose buckets already divide by N it is the model's.

Traffic per step, wire bytes per rank (what a ring sends; minitron.runtime.comm counts it), m micro-batches:
    stages 0, 1, 2   2 (N-1)/N * 2Ψ      (all-reduce = reduce-scatter + all-gather), once: the
                                         micro-batches accumulate under no_sync
    stage 3          3m (N-1)/N * 2Ψ     (all-gather twice, reduce-scatter once, per micro-batch:
                                         1.5x at m = 1; zero3.py says why per micro-batch)
Hybrid sharding (HSDP: N = S x R, ZeRO over the S ranks of a shard group, R copies of each
shard): memory is the table's with N = S, and the traffic splits by group,

    shard group       the ZeRO collectives above with N = S     (fast links: inside a node)
    dp_replicate      2 (R-1)/R * 2Ψ/S, once per step            (the all-reduce of the kept
                                                                 1/S of the gradient)

so the slow links carry 2 (R-1)/R * 2Ψ/S bytes per rank instead of flat ZeRO's 2 (N-1)/N * 2Ψ
(stage 3: 3m (N-1)/N * 2Ψ): S times less, at S/N of ZeRO's memory saving.
A pipeline rank's Ψ is its stages' parameters: the data-parallel group of a pipeline rank holds
the same stages, and the formulas hold for it with Ψ = Ψ_rank.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from .engine_api import GradientEngine


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def measure(model: nn.Module, engine: GradientEngine, optimizer) -> StateBytes:
    """The bytes this rank holds now for `model`'s parameters, their gradients and `optimizer`'s
    state (a ZeroOptimizer, or a torch optimizer: every tensor in its state)."""
    params = list(model.parameters())
    if hasattr(optimizer, "state_tensors"):
        state = optimizer.state_tensors()
    else:
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
    return StateBytes(params=_storage_bytes(params + engine.param_tensors()),
                      grads=_storage_bytes([p.grad for p in params] + engine.grad_tensors()),
                      optimizer=_storage_bytes(state))


def formula_bytes(psi: int, n: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
                  optimizer_bytes: int = 12) -> StateBytes:
    """The ZeRO paper's per-rank bytes (see the module docstring); psi must divide by n."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain data parallel), 1, 2 or 3, got {stage!r}")
    if stage and psi % n:
        raise ValueError(f"psi={psi} is not divisible by n={n}: pass the padded count "
                         "(engine.padded_numel)")
    shard = lambda b, from_stage: b * psi // n if stage >= from_stage else b * psi
    return StateBytes(params=shard(param_bytes, 3), grads=shard(grad_bytes, 2),
                      optimizer=shard(optimizer_bytes, 1))


def traffic_wire_bytes(psi: int, n: int, stage: int, elem_bytes: int = 2,
                       microbatches: int = 1) -> float:
    """Wire bytes per rank per step of the data-parallel collectives (module docstring)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if microbatches < 1:
        raise ValueError(f"a step has at least one micro-batch, got microbatches={microbatches}")
    passes = 3 * microbatches if stage == 3 else 2
    return passes * (n - 1) / n * elem_bytes * psi


def hsdp_wire_bytes(psi: int, shard: int, replicas: int, stage: int, elem_bytes: int = 2,
                    microbatches: int = 1) -> dict[str, float]:
    """Wire bytes per rank per step of hybrid sharding, by group (module docstring): the shard
    group's ZeRO collectives, and the all-reduce of the kept 1/shard across the replicas."""
    if stage not in (1, 2, 3):
        raise ValueError(f"hybrid sharding shards ZeRO's state: stage 1, 2 or 3, got {stage!r}")
    if psi % shard:
        raise ValueError(f"psi={psi} is not divisible by shard={shard}: pass the padded count")
    return {"shard": traffic_wire_bytes(psi, shard, stage, elem_bytes, microbatches),
            "replicate": 2 * (replicas - 1) / replicas * elem_bytes * psi / shard}
