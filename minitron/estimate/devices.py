"""What one device and one group's link cost the step-time model: a GEMM's seconds on a GPU
(roofline with wave quantization), and the link a group's members talk over, from where the
tp-cp-ep-dp-pp rank layout places them."""
from __future__ import annotations

import math

from ..hardware import GPU, point_to_point_link, ring_link

DIMS = ("tp", "cp", "ep", "dp", "pp")   # fastest first, as minitron/grid/ lays ranks out


def gemm_seconds(m: int, n: int, k: int, gpu: GPU, batch: int = 1, tile: int = 128) -> float:
    """One (batched) 16-bit GEMM [m, k] x [k, n]: roofline with wave quantization, at the
    sustained matmul rate (the best burst's efficiency times hardware.GPU.sustained: a training
    step runs at the power-limited clock, not the boost clock of a short benchmark)."""
    tiles = batch * math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / gpu.sms)
    fill = tiles / (waves * gpu.sms)
    compute = 2 * batch * m * n * k / (gpu.peak_flops * gpu.matmul_eff * gpu.sustained * fill)
    memory = 2 * batch * (m * k + k * n + m * n) / (gpu.hbm_bw * gpu.hbm_eff)
    return max(compute, memory)


def flash_attention_seconds(rows: int, keys: int, head_dim: int, gpu: GPU, batch: int,
                            utilization: float | None = None) -> float:
    """The forward of a fused (flash) attention core over `batch` heads: its two products with the
    causal mask's skipped tiles (about half), at `utilization` of peak where the software's kernel
    has a published figure on this GPU, else at the sustained matmul rate; the s x s scores stay on
    chip, so only Q, K, V and the output cross HBM (no s^2 bytes)."""
    flops = 2 * 2 * batch * rows * keys * head_dim / 2
    rate = gpu.peak_flops * (utilization if utilization else gpu.matmul_eff * gpu.sustained)
    hbm = 2 * batch * head_dim * (2 * rows + 2 * keys)          # Q, O [rows, d]; K, V [keys, d]
    return max(flops / rate, hbm / (gpu.hbm_bw * gpu.hbm_eff))


def _linear_seconds(m: int, n: int, k: int, gpu: GPU, batch: int = 1) -> tuple[float, float]:
    """(forward, backward) of y = x W: backward is dX = dY W^T and dW = X^T dY."""
    fwd = gemm_seconds(m, n, k, gpu, batch)
    return fwd, gemm_seconds(m, k, n, gpu, batch) + gemm_seconds(k, n, m, gpu, batch)


def members_per_node(dim: str, par, gpus_per_node: int) -> int:
    """How many of a `dim` group's members share a node (1 when groups straddle nodes unevenly)."""
    stride = math.prod(getattr(par, d) for d in DIMS[:DIMS.index(dim)])
    size = getattr(par, dim)
    if stride * size <= gpus_per_node:
        return size if gpus_per_node % (stride * size) == 0 else 1
    return gpus_per_node // stride if gpus_per_node % stride == 0 and stride < gpus_per_node else 1


def link(dim: str, par, cluster, point_to_point: bool = False) -> tuple[float, float]:
    """(bytes/s, latency s) of one member of group `dim`, from where its members sit."""
    k, size = members_per_node(dim, par, cluster.gpus_per_node), getattr(par, dim)
    if point_to_point:                    # the link model is minitron/hardware.py's
        return point_to_point_link(cluster.gpu, crosses_nodes=k < size)
    return ring_link(cluster.gpu, size, k)
