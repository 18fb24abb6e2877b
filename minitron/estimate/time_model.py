"""How long one training step takes on a cluster, term by term, from shapes and hardware alone.

One step = m micro-batches of b sequences through a pipeline of p ranks (v chunks each),
replicated dp times, every layer split over tp (and cp, ep). The terms, each in the file that
says how it is counted:

  layer_time.py      per micro-batch and layer, on one rank: compute (every GEMM at the
                     sustained matmul rate, with wave quantization), the memory-bound kernels
                     between them, the TP, CP and EP collectives; the embedding and output layer
  pipeline_time.py   per step: the bubble, uneven stages, the activations crossing stage
                     boundaries
  optimizer_time.py  per step: the data-parallel gradient reduction (or ZeRO-3's gathers), the
                     gradient accumulation, the optimizer step
  parallel.py        what they are given: Parallel (the split) and Cluster (GPU and node)

The step is the busiest stage's m micro-batches (the one holding the output layer, or a middle
one when the first and last are lighter), plus the bubble, the pipeline's sends, the exposed DP
communication, the accumulation and the optimizer.

Which software runs decides several of these (software.py, one named feature set per release):
flash attention, TP communication overlapped with the GEMMs, the data-parallel reduction
overlapped with the last micro-batch's backward, gradient-accumulation fusion, the bytes of a
reduced gradient, the pipeline's scatter/gather.

A group's bandwidth is minitron/hardware.py's link model: inside a node, NVLink's; a ring
collective that crosses nodes with k members per node gets k NICs' worth (NCCL's rings leave the
node once per NIC), at most NVLink's; a send (PP) or an all-to-all (EP) leaves through the GPU's
own NIC. Members per node follow the tp-cp-ep-dp-pp rank layout of minitron/grid/ (tp fastest).
Latency is NCCL's own model (hardware.py): a ring collective of n ranks takes n - 1 steps per
phase, each at the latency of its link (inside a node or across), plus one base latency per
collective, so it grows linearly with the group as NCCL's ring algorithm does.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..hardware import ring_seconds                     # lesson 13 imports it here
from .devices import gemm_seconds, link                 # lesson 13 imports them here
from .flops import iteration_flops
from .layer_time import head_seconds, layer_seconds
from .optimizer_time import (accumulation_seconds, dense_params_per_rank, dp_seconds,
                             optimizer_seconds, params_per_rank)
from .parallel import Cluster, Parallel
from .pipeline_time import SCHEDULE_BUBBLE, bubble_seconds, pp_seconds
from .software import SOFTWARE, Software, software as named_software

__all__ = ["Breakdown", "Cluster", "Parallel", "SCHEDULE_BUBBLE", "SOFTWARE", "Software",
           "dense_params_per_rank", "gemm_seconds", "layer_seconds", "link", "params_per_rank",
           "ring_seconds", "step_time"]


@dataclasses.dataclass(frozen=True)
class Breakdown:
    terms: dict           # seconds per step, by term
    microbatches: int
    flops: float          # hardware FLOPs per step (recomputation counted)
    model_flops: float    # without recomputation
    gpus: int
    tokens: int
    peak: float

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def flops_per_gpu(self) -> float:
        return self.flops / self.seconds / self.gpus

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.gpus / self.peak

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def step_time(cfg: ModelConfig, par: Parallel, cluster: Cluster, global_batch: int,
              seq: int | None = None, software: str = "minitron") -> Breakdown:
    """The predicted step, by term (see the module docstring), under the named software."""
    seq = seq or cfg.seq_len
    sw = named_software(software)
    m = global_batch // (par.dp * par.ep * par.micro_batch)
    if m < 1 or global_batch % (par.dp * par.ep * par.micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of dp*ep*micro_batch = "
                         f"{par.dp * par.ep * par.micro_batch}")
    layers = par.stage_layers(cfg.n_layers)         # a stage's layers, MoE every k-th
    dense_layer = layer_seconds(cfg, par, cluster, seq, False, sw)
    moe_layer = layer_seconds(cfg, par, cluster, seq, True, sw) if cfg.n_experts else None

    def stage_terms(n: int) -> dict:
        n_moe = sum(cfg.is_moe_layer(i) for i in range(n)) if cfg.n_experts else 0
        out = {k: (n - n_moe) * v for k, v in dense_layer.items()}
        for k, v in (moe_layer or {}).items():
            out[k] += n_moe * v
        return out
    per_stage = stage_terms(layers)
    busiest = stage_terms(layers - par.trim)        # the stage with the output layer (and embedding)
    for k, v in head_seconds(cfg, par, cluster, seq).items():
        busiest[k] += v
    if sum(per_stage.values()) > sum(busiest.values()):
        busiest = per_stage                         # uneven stages: a middle stage is the slowest
    terms = {k: m * v for k, v in busiest.items()}

    terms["bubble"] = bubble_seconds(par, sum(per_stage.values()))
    terms["PP send/recv"] = pp_seconds(cfg, par, cluster, sw, seq, m, sum(per_stage.values()))
    terms["DP comm"] = dp_seconds(cfg, par, cluster, sw, m, busiest["compute"])
    terms["grad accumulation"] = accumulation_seconds(cfg, par, cluster, sw, m)
    terms["optimizer"] = optimizer_seconds(cfg, par, cluster, sw)

    flops = iteration_flops(cfg, global_batch, seq, par.recompute)
    model_flops = iteration_flops(cfg, global_batch, seq, "none")
    return Breakdown(terms, m, flops, model_flops, par.gpus, global_batch * seq, cluster.gpu.peak_flops)
