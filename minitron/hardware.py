"""The one hardware model of the course: each GPU's data sheet, the node it comes in, and how fast
a group of its ranks talks (the alpha-beta link model). The planner (estimate/time_model.py),
the placement warning (runtime/placement.py) and the lessons all read their figures here, so a
bandwidth is never quoted two ways. It imports nothing of minitron: every floor may read it.

Data sheets (dense 16-bit tensor-core peak, no sparsity; bandwidths per GPU and direction):

    GPU                 peak FLOP/s  memory    HBM B/s   NVLink B/s            node: GPUs, NICs x rate
    V100 SXM3 (DGX-2H)  130e12       32 GiB    0.9e12    150e9 (NVSwitch)      16, 8 x 100 Gb/s EDR
    A100 SXM4 80 GB     312e12       80 GiB    2.039e12  300e9 (NVLink 3)      8, 8 x 200 Gb/s HDR
    H100 SXM5           989e12       80 GiB    3.35e12   450e9 (NVLink 4)      8, 8 x 400 Gb/s NDR
    H200 SXM            989e12       141 GB    4.8e12    450e9 (NVLink 4)      8, 8 x 400 Gb/s NDR

  - V100: Shoeybi et al. 2019 (Megatron-LM), section 5: DGX-2H servers of 16 V100 SXM3 32 GB,
    300 GB/s between GPUs through NVSwitch (both directions: 150 each way), 8 InfiniBand adapters
    per server; their 39 TFLOP/s on one GPU is "30% of the theoretical peak", i.e. 130e12 (the
    DGX-2H's V100s run at 450 W, above the 125e12 of a 300 W V100 SXM2). NVIDIA ADLR's
    "MegatronLM's Supercharged V1.0" (nv-adlr.github.io/MegatronLMV1) states the same peak: its
    62.4 TFLOP/s is "48% of the theoretical peak FLOPS for a single GPU in a DGX2-H server"
    (62.4 / 0.48 = 130e12). One peak per GPU: the planner, flops and the lessons read this one.
  - A100: NVIDIA A100 Tensor Core GPU data sheet (312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e,
    600 GB/s NVLink both directions); DGX A100 data sheet: 8 single-port ConnectX-6 HDR 200 Gb/s
    for the compute fabric (Selene, where Narayanan et al. 2021 and Korthikanti et al. 2022 ran).
  - H100: NVIDIA H100 Tensor Core GPU data sheet, SXM5 (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3,
    900 GB/s NVLink both directions, 18 links); DGX H100: 8 ConnectX-7 NDR 400 Gb/s, one per GPU.
  - H200: NVIDIA H200 data sheet (the H100's compute die: 989e12; 141 GB HBM3e at 4.8 TB/s,
    NVLink 900 GB/s); DGX H200 has the DGX H100's eight 400 Gb/s NICs.

What is achieved of it (constants of the hardware, measured by microbenchmarks, never fitted to a
training run):
  matmul     the best large bf16 GEMM over shapes (Bekman, ml-engineering, compute/accelerator
             README, "Maximum Achievable Matmul FLOPS comparison table", the version of stas00/
             ml-engineering 249778b, 2024-08-07, both measured with CUDA 12.1): A100 SXM 267.9 of
             312 TFLOP/s (0.859), H100 SXM 792.1 of 989 (0.801); H200 taken as H100 (same compute
             die); V100 0.80 (an assumption: cuBLAS fp16 large GEMMs, not in that table). Later
             versions of the table re-measured both with newer torch (A100 271.2, torch 2.6;
             H100 794.5, torch 2.7): one version is used for both, the one nearer the runs'
             software. These are short bursts (100 iterations after 50 warm-ups), at the boost
             clock. No other published A100 bf16 GEMM measurement at training shapes was found.
  sustained  what a GEMM keeps once the GPU has heated to its power limit, over the burst: the
             same benchmark's "Maximum Sustainable Matmul FLOPS" (MSMF) against its "Maximum
             Achievable" (MAMF) burst, measured with all 8 GPUs of the node computing at once
             (Bekman, ml-engineering, compute/accelerator/benchmarks/README.md, "What we measured:
             alone vs all-8 concurrent"): H200 698.6 / 823.9 TFLOP/s = 0.848 (B200 1426.4 / 1751.2
             = 0.815; one GPU alone, H200 702.9 / 828.0 = 0.849). A training step keeps every GPU
             busy for seconds, so it runs at the sustained rate: 0.848 for every GPU. Measured on
             Hopper (the H100's die, the same 700 W) and Blackwell; for the A100 and the V100 it is
             an assumption, not a measurement (no MSMF of theirs is published there).
  HBM        a streaming copy reaches ~0.85-0.9 of the data sheet's bandwidth: 0.85 (NOT cited:
             no published stream measurement on these GPUs is referenced here).
  NVLink     an all-reduce's bus bandwidth inside a node at 16 GiB (Bekman, ml-engineering,
             network/README.md, "busbw @16GiB" table): A100 NVLink 3 234.89 of 300 GB/s (78%):
             0.78; H200 NVLink 4 with NCCL's ring (NVLS off, no NVLink SHARP) 367.61 of 450 (82%).
             The H100's 0.80 is rounded below that measurement (the H200 has its NVLink); the
             measured 0.817 would move the 28 published points' mean |error| by about +0.02.
  network    0.9 of the NICs' line rate (NOT cited). The published figures bracket it: a single
             adapter's RDMA writes reach 96.9% of line rate (ib_write_bw, EFA, Bekman network
             README), an all-reduce across 4 nodes drives each accelerator's NIC at 73.9% of it
             (36.95 of 50 GB/s, P6-B200 EFA, 16 GiB; a floor, and its author warns it does not carry
             to other fabrics). Selene's HDR InfiniBand, Meta's RoCE and the DGX-2H's EDR are none
             of these, so 0.9 stays an assumption (published.py's sensitivity table shows its weight).
  latency    NCCL's own latency model, the one its tuner picks algorithms with (NVIDIA/nccl,
             src/graph/tuning.cc, ncclTunerConstantsDefaults and ncclTopoTuneModel; commit
             5067397, 2026): a ring collective with the Simple protocol (the one for the MB-sized
             buffers of training) costs a base of 8.4 us, plus 3.4 us per step inside a node over
             NVLink and 14 us per step that crosses nodes (intra-node steps of a ring that leaves
             the node: max(3.4, 3 x netOverhead = 3.0) us, so 3.4). An all-reduce has 2(N-1) steps,
             2(nodes-1) of them between nodes; an all-gather or reduce-scatter half as many.
             A point-to-point send pays one step's latency.

The link model (alpha-beta): a message of n bytes over a link costs alpha + n / beta. A ring
collective over a group of N ranks moves (N-1)/N of the buffer per rank per phase (all-reduce: two
phases, reduce-scatter then all-gather; all-gather or reduce-scatter alone: one), in N-1 steps:

    t = phases * ((N-1)/N * bytes / busbw + (N-1) * alpha) + base               (ring_seconds)

where alpha is the steps' mean latency, nvlink_latency + (net_latency - nvlink_latency) x
(nodes-1)/(N-1) (the share of a ring's steps that cross nodes is the same in either phase), and
base is GPU.collective_latency, paid once per collective.

busbw, one rank's bus bandwidth, depends on where the group's members sit:
  - all in one node: NVLink's, busbw = nvlink_bw * nvlink_eff.
  - spread over nodes, k members on each: a ring ordered node by node leaves each node once, so
    one ring moves all its cross-node bytes through one NIC. NCCL builds one ring (channel) per
    NIC and splits the buffer over them, so a group with k members per node drives k NICs (the
    other groups on the node, e.g. the other tensor-parallel ranks' data-parallel groups, run
    their collectives at the same time and drive the others):
        busbw = min(k * net_bw * net_eff, nvlink_bw * nvlink_eff),
    where net_bw = NICs per node x NIC rate / GPUs per node is one GPU's share of the NICs. On
    DGX H100 a flat dp64 (8 members per node) or a two-node tp16 gets min(8 x 50 x 0.9, 360) =
    360 GB/s, NVLink's own; a dp group with one member per node (tp8 inside the node) gets one
    NIC, 45 GB/s.                                                                  (ring_link)
  - a point-to-point send (pipeline stages) or an all-to-all (expert dispatch) leaves the node
    through the sending GPU's own NIC share: min(net_bw * net_eff, NVLink's).   (point_to_point_link)
This is a model of the bandwidth NCCL can reach, not a measurement in this repository; nothing on
this machine has more than one node.
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
    net_bw: float               # bytes/s per GPU per direction across nodes: its share of the node's NICs
    sms: int = 108              # streaming multiprocessors (wave quantization)
    matmul_eff: float = 0.8     # best achieved fraction of peak on a large GEMM (a burst)
    sustained: float = 698.6 / 823.9   # sustained / burst matmul rate at the power limit
    hbm_eff: float = 0.85
    nvlink_eff: float = 0.78
    net_eff: float = 0.9
    nvlink_latency: float = 3.4e-6      # NCCL's ring step inside a node (Simple protocol)
    net_latency: float = 14e-6          # NCCL's ring step between nodes (Simple protocol)
    collective_latency: float = 8.4e-6  # NCCL's base latency of a ring collective (Simple)

    def __post_init__(self):
        for field in ("peak_flops", "memory_bytes", "hbm_bw", "nvlink_bw", "net_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)!r}")
        if not 0 < self.sustained <= 1:
            raise ValueError(f"sustained must be in (0, 1], got {self.sustained!r}")


def nic_share(nics: int, gbit_per_s: float, gpus: int) -> float:
    """One GPU's share of its node's NICs, bytes/s per direction."""
    return nics * gbit_per_s * 1e9 / 8 / gpus


GPUS = {
    "v100": GPU("V100 SXM3 32GB (DGX-2H)", 130e12, 32 * GIB, 0.9e12, 150e9, nic_share(8, 100, 16),
                sms=80, matmul_eff=0.80, nvlink_eff=0.78),
    "a100": GPU("A100 SXM4 80GB", 312e12, 80 * GIB, 2.039e12, 300e9, nic_share(8, 200, 8), sms=108,
                matmul_eff=267.9 / 312, nvlink_eff=0.78),
    "h100": GPU("H100 SXM5 80GB", 989e12, 80 * GIB, 3.35e12, 450e9, nic_share(8, 400, 8), sms=132,
                matmul_eff=792.1 / 989, nvlink_eff=0.80),
    "h200": GPU("H200 SXM 141GB", 989e12, 141e9, 4.8e12, 450e9, nic_share(8, 400, 8), sms=132,
                matmul_eff=792.1 / 989, nvlink_eff=0.80),
}
GPUS_PER_NODE = {"v100": 16, "a100": 8, "h100": 8, "h200": 8}     # DGX-2H, DGX A100/H100/H200

# Dense 16-bit peaks of GPUs the course only measures on (never plans for): data sheets.
OTHER_PEAKS = {"A10G": 125e12, "L4": 121e12, "T4": 65e12}


def gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)} "
                         "(or describe one: peak FLOP/s, memory, NVLink and network bandwidths)")
    return GPUS[name.lower()]


def peak_of(device_name: str) -> float | None:
    """The dense 16-bit peak of a device named like torch.cuda.get_device_name ("NVIDIA H200"),
    None for one without a data sheet here."""
    for key, g in GPUS.items():
        if key in device_name.lower():
            return g.peak_flops
    return next((peak for key, peak in OTHER_PEAKS.items() if key.lower() in device_name.lower()), None)


def ring_link(g: GPU, group_size: int, members_per_node: int) -> tuple[float, float]:
    """(bus bandwidth B/s, mean latency per step s) of one member of a ring collective over
    `group_size` ranks with `members_per_node` of them on each node (the module docstring)."""
    nvlink = g.nvlink_bw * g.nvlink_eff
    if members_per_node >= group_size:
        return nvlink, g.nvlink_latency
    nodes = group_size / max(1, members_per_node)
    step = g.nvlink_latency + (g.net_latency - g.nvlink_latency) * (nodes - 1) / (group_size - 1)
    return min(nvlink, members_per_node * g.net_bw * g.net_eff), step


def point_to_point_link(g: GPU, crosses_nodes: bool) -> tuple[float, float]:
    """(bytes/s, latency s) of a send, or of an all-to-all's traffic, from one GPU: across nodes
    it leaves through that GPU's own share of the NICs."""
    if not crosses_nodes:
        return g.nvlink_bw * g.nvlink_eff, g.nvlink_latency
    return min(g.nvlink_bw * g.nvlink_eff, g.net_bw * g.net_eff), g.net_latency


def ring_seconds(nbytes: float, n: int, bw_lat: tuple[float, float], phases: int = 2,
                 base: float = GPU.collective_latency) -> float:
    """A ring all-reduce (phases=2) or all-gather / reduce-scatter (1) of an n-rank group: its
    steps' bytes and latencies (ring_link), and NCCL's base latency once."""
    if n == 1:
        return 0.0
    bw, lat = bw_lat
    return phases * ((n - 1) / n * nbytes / bw + (n - 1) * lat) + base


def cpu(peak_flops: float, mem_bw: float, link_bw: float, latency: float) -> GPU:
    """This CPU as a one-node machine whose 'GPUs' are processes: measured peak matmul FLOP/s
    (the efficiencies are then 1: the peak is already what a GEMM achieves), measured memory
    bandwidth, and gloo's measured all-reduce bandwidth and latency between processes (measured as
    it runs: nothing sustained to discount)."""
    return GPU("this CPU", peak_flops, 64 * GIB, mem_bw, link_bw, link_bw, sms=1, matmul_eff=1.0,
               sustained=1.0, hbm_eff=1.0, nvlink_eff=1.0, net_eff=1.0, nvlink_latency=latency,
               net_latency=latency, collective_latency=0.0)


__all__ = ["GIB", "GPU", "GPUS", "GPUS_PER_NODE", "OTHER_PEAKS", "gpu", "peak_of", "nic_share",
           "ring_link", "point_to_point_link", "ring_seconds", "cpu"]
