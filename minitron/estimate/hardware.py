"""The machines the planner knows: each GPU's published specification and what microbenchmarks
achieve of it.

Specification (vendor data sheets; dense 16-bit tensor-core peak, no sparsity):

    GPU                 peak FLOP/s  memory    HBM B/s   NVLink B/s per direction   network per GPU
    V100 SXM3 (DGX-2H)  130e12       32 GiB    0.9e12    150e9 (NVSwitch, 16/node)  6.25e9 (8x100 Gb/s per 16)
    A100 SXM4 80 GB     312e12       80 GiB    2.039e12  300e9 (NVLink 3, 600 both) 25e9 (HDR 200 Gb/s)
    H100 SXM5           989e12       80 GiB    3.35e12   450e9 (NVLink 4, 900 both) 50e9 (NDR 400 Gb/s)
    H200 SXM            989e12       141 GB    4.8e12    450e9                      50e9

(The DGX-2H's V100s run at 450 W and higher clocks: Shoeybi et al. 2019 quote their 39 TFLOP/s
as 30% of peak, i.e. 130e12.)

What is achieved of it (the efficiencies below are constants of the hardware, measured by
microbenchmarks, never fitted to a training run):
  matmul     the best large bf16 GEMM over shapes ("maximum achievable matmul FLOPS", Bekman's
             ml-engineering benchmark): A100 271 of 312 TFLOP/s (0.87), H100 795 of 989 (0.80);
             H200 taken as H100 (same compute die); V100 0.80 (cuBLAS fp16 large GEMMs).
             Shape enters through wave quantization (time_model.gemm_seconds).
  HBM        a streaming copy reaches ~0.85-0.9 of the data sheet's bandwidth: 0.85.
  NVLink     nccl-tests all-reduce bus bandwidth inside a node: ~230 of 300 GB/s on DGX A100,
             ~360 of 450 on DGX H100 (no NVLink SHARP): 0.78 / 0.80.
  network    nccl-tests across nodes reach ~0.9 of the NICs' line rate.
  latency    a collective's fixed cost: ~10 us on NVLink, ~20 us across the network.
"""
from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float           # dense 16-bit tensor-core FLOP/s
    memory_bytes: float
    hbm_bw: float               # bytes/s
    nvlink_bw: float            # bytes/s per GPU per direction, inside a node
    net_bw: float               # bytes/s per GPU per direction, across nodes
    sms: int = 108              # streaming multiprocessors (wave quantization)
    matmul_eff: float = 0.8     # best achieved fraction of peak on a large GEMM
    hbm_eff: float = 0.85
    nvlink_eff: float = 0.78
    net_eff: float = 0.9
    nvlink_latency: float = 10e-6
    net_latency: float = 20e-6
    gpus_per_node: int = 8      # the node this GPU usually comes in (DGX/HGX)

    def __post_init__(self):
        for field in ("peak_flops", "memory_bytes", "hbm_bw", "nvlink_bw", "net_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)!r}")


GPUS = {
    "v100": GPU("V100 SXM3 32GB (DGX-2H)", 130e12, 32 * GIB, 0.9e12, 150e9, 6.25e9, sms=80,
                matmul_eff=0.80, nvlink_eff=0.78, gpus_per_node=16),
    "a100": GPU("A100 SXM4 80GB", 312e12, 80 * GIB, 2.039e12, 300e9, 25e9, sms=108,
                matmul_eff=0.87, nvlink_eff=0.78),
    "h100": GPU("H100 SXM5 80GB", 989e12, 80 * GIB, 3.35e12, 450e9, 50e9, sms=132,
                matmul_eff=0.80, nvlink_eff=0.80),
    "h200": GPU("H200 SXM 141GB", 989e12, 141e9, 4.8e12, 450e9, 50e9, sms=132,
                matmul_eff=0.80, nvlink_eff=0.80),
}


def gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)} "
                         "(or describe one: peak FLOP/s, memory, NVLink and network bandwidths)")
    return GPUS[name.lower()]


def cpu(peak_flops: float, mem_bw: float, link_bw: float, latency: float, cores: int) -> GPU:
    """This CPU as a one-node machine whose 'GPUs' are processes: measured peak matmul FLOP/s
    (the efficiencies are then 1: the peak is already what a GEMM achieves), measured memory
    bandwidth, and gloo's measured all-reduce bandwidth and latency between processes."""
    return GPU("this CPU", peak_flops, 64 * GIB, mem_bw, link_bw, link_bw, sms=1, matmul_eff=1.0,
               hbm_eff=1.0, nvlink_eff=1.0, net_eff=1.0, nvlink_latency=latency,
               net_latency=latency, gpus_per_node=cores)
