"""The pipeline's terms of one step: the bubble and the activations crossing stage boundaries.

  bubble      (p-1)/v stage-times idle (1F1B, GPipe; interleaved divides by v; ZB-H1 a third)
  uneven      Parallel.trim: the first and last stage hold `trim` layers fewer than the middle
              ones (Llama 3, Dubey et al. 2024, §3.3.2: one layer fewer on each, to balance the
              embedding and the output layer); the slowest stage sets the step (time_model.py)
  PP          each micro-batch's activation and gradient cross each stage boundary (v times
              per rank with interleaving), exposed: split over tp under SP; without SP,
              Megatron 2021-22's scatter/gather sends 1/tp and all-gathers it over the TP group
              on arrival; later software (and minitron) sends the whole activation. Megatron-Core's
              interleaved schedule overlaps each send with the next chunk's compute
              (overlap_p2p_comm, on by default; Llama 3 did the same, Dubey et al. 2024 §3.3.2,
              "asynchronous point-to-point communication"): a forward's send beside a chunk's
              forward, a backward's beside a backward, so only what exceeds half of one
              chunk's forward and backward of one micro-batch shows
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hardware import ring_seconds
from .devices import link
from .parallel import Cluster, Parallel
from .software import Software

SCHEDULE_BUBBLE = {"1f1b": 1.0, "gpipe": 1.0, "interleaved": 1.0, "zb-h1": 1 / 3}


def bubble_seconds(par: Parallel, stage: float) -> float:
    """The pipeline's idle time in one step; `stage` is one stage's forward and backward of one
    micro-batch."""
    return SCHEDULE_BUBBLE[par.schedule] * (par.pp - 1) / par.virtual * stage


def pp_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, sw: Software, seq: int,
               microbatches: int, stage: float) -> float:
    """Every stage-boundary exchange of one step: each micro-batch's activation forward and its
    gradient backward, v times per rank; `stage` is one rank's forward and backward of one
    micro-batch (all its chunks), what an overlapped send hides behind."""
    if par.pp == 1:
        return 0.0
    one = _exchange_seconds(cfg, par, cluster, sw, seq)
    if sw.overlap_p2p and par.virtual > 1:       # beside one chunk's forward or backward
        one = max(0.0, one - stage / (2 * par.virtual))
    return microbatches * par.virtual * 2 * one


def _exchange_seconds(cfg, par, cluster, sw, seq) -> float:
    """One activation (or its gradient) across a stage boundary, exposed. Under SP it is already
    split over tp; without SP, Megatron's scatter/gather (megatron/p2p_communication.py, 2021-22)
    sends 1/tp of it and all-gathers it over the TP group on arrival (gather_split_1d_tensor, on
    the critical path); without that optimisation every TP rank sends the whole activation."""
    full = 2 * par.micro_batch * seq // par.cp * cfg.hidden
    split = par.sp or sw.pp_scatter_gather
    bw, lat = link("pp", par, cluster, point_to_point=True)
    send = (full / par.tp if split else full) / bw + lat
    if sw.pp_scatter_gather and not par.sp:
        send += ring_seconds(full, par.tp, link("tp", par, cluster), phases=1, base=cluster.gpu.collective_latency)
    return send
