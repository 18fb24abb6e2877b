"""How long one training step takes on a cluster, term by term, from shapes and hardware alone.

One step = m micro-batches of b sequences through a pipeline of p ranks (v chunks each),
replicated dp times, every layer split over tp (and cp, ep). Per micro-batch and layer, on one rank:

  compute     every matrix multiplication of the layer (QKV, out-projection, fc1, fc2, the
              attention core's two batched products), forward, backward (the input's gradient
              and the weight's: two GEMMs of the forward's size) and the recomputation
              (full: the forward again; selective: the core again). A GEMM's time is the
              larger of its FLOPs at the achieved matmul rate and its bytes at HBM speed, its
              FLOP rate cut by wave quantization: its 128x128 output tiles fill the GPU's
              SMs in whole waves, and a last partial wave runs at the cost of a full one.
  memory-bound the kernels between the GEMMs, as Megatron fuses them (2-byte activations):
              per forward 22 R (two LayerNorms: 4 R each; two bias-dropout-adds: read 2, read
              residual 2, write 2, 1-byte mask) + 16 E/t (bias-GeLU on the 4h hidden) + 9 S
              (fused scale-mask-softmax 4 S, dropout 5 S) bytes, with E = b s h, R = E (E/t under
              SP), S = b (a/t) s^2; backward moves twice the forward's bytes.
  TP          per forward 2 all-reduces of 2E bytes (SP: 2 all-gathers + 2 reduce-scatters,
              the same bytes), 2 more in backward, 2 more when the forward is recomputed;
              a ring all-reduce moves 2(t-1)/t of the buffer at the group's bandwidth. Not
              overlapped (Megatron's TP is synchronous).
  CP          the ring passes K and V (cp-1) times forward, and K, V and their gradients
              backward; overlapped with the attention core, only the excess shows.
  EP          all-to-all dispatch and combine of the top-k tokens, forward and backward.
Per step:
  bubble      (p-1)/v stage-times idle (1F1B, GPipe; interleaved divides by v; ZB-H1 a third)
  PP          each micro-batch's activation and gradient cross each stage boundary (v times
              per rank with interleaving), split over tp (Megatron's scatter-gather), exposed
  DP          the gradients (2 bytes each) reduce-scattered and all-gathered (an all-reduce's
              bytes; ZeRO-3 gathers the parameters once more: 1.5x). Without a pipeline the
              engine overlaps them with the last micro-batch's backward (data_parallel/ddp.py);
              after a pipeline's flush they are exposed.
  optimizer   Adam over the rank's fp32 master shard: 28 bytes per parameter at HBM speed.
  grad accumulation  without Megatron's gradient-accumulation fusion (the weight-gradient GEMM
              adding into the fp32 main grad, 2022), each micro-batch's 16-bit weight gradient
              is added to it afterwards: 10 bytes per parameter per micro-batch at HBM speed.

Which software runs decides two of these (SOFTWARE): Megatron-LM as of Narayanan et al. 2021
(no accumulation fusion, data-parallel reduction after the backward), as of Korthikanti et al.
2022 (accumulation fused), and Megatron-Core / minitron's engine (fused, and the data-parallel
reduction overlapped with the backward when there is no pipeline).

A group's bandwidth is minitron/hardware.py's link model: inside a node, NVLink's; a ring
collective that crosses nodes with k members per node gets k NICs' worth (NCCL's rings leave the
node once per NIC), at most NVLink's; a send (PP) or an all-to-all (EP) leaves through the GPU's
own NIC. Members per node follow the tp-cp-ep-dp-pp rank layout of minitron/grid.py (tp fastest).
"""
from __future__ import annotations

import dataclasses
import math

from ..config import ModelConfig
from .flops import iteration_flops
from ..hardware import GPU, point_to_point_link, ring_link, ring_seconds

DIMS = ("tp", "cp", "ep", "dp", "pp")   # fastest first, as minitron/grid.py lays ranks out
SCHEDULE_BUBBLE = {"1f1b": 1.0, "gpipe": 1.0, "interleaved": 1.0, "zb-h1": 1 / 3}
ADAM_BYTES = 28            # read+write fp32 master, m, v (24), read the grad, write the 16-bit copy


@dataclasses.dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"      # "interleaved" when virtual > 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    def label(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        if self.virtual > 1:
            parts.append(f"v{self.virtual}")
        parts += [f"dp{self.dp}"] + [f"{d}{getattr(self, d)}" for d in ("cp", "ep") if getattr(self, d) > 1]
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}", self.recompute, self.schedule]
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Software:
    name: str
    accumulation_fusion: bool    # the wgrad GEMM accumulates into the fp32 main grad
    overlap_dp: bool             # gradient buckets reduced during the backward (no pipeline)


SOFTWARE = {"megatron-2021": Software("megatron-2021", False, False),
            "megatron-2022": Software("megatron-2022", True, False),
            "megatron-core": Software("megatron-core", True, True)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8


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


def gemm_seconds(m: int, n: int, k: int, gpu: GPU, batch: int = 1, tile: int = 128) -> float:
    """One (batched) 16-bit GEMM [m, k] x [k, n]: roofline with wave quantization."""
    tiles = batch * math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / gpu.sms)
    fill = tiles / (waves * gpu.sms)
    compute = 2 * batch * m * n * k / (gpu.peak_flops * gpu.matmul_eff * fill)
    memory = 2 * batch * (m * k + k * n + m * n) / (gpu.hbm_bw * gpu.hbm_eff)
    return max(compute, memory)


def _linear_seconds(m: int, n: int, k: int, gpu: GPU, batch: int = 1) -> tuple[float, float]:
    """(forward, backward) of y = x W: backward is dX = dY W^T and dW = X^T dY."""
    fwd = gemm_seconds(m, n, k, gpu, batch)
    return fwd, gemm_seconds(m, k, n, gpu, batch) + gemm_seconds(k, n, m, gpu, batch)


def members_per_node(dim: str, par: Parallel, gpus_per_node: int) -> int:
    """How many of a `dim` group's members share a node (1 when groups straddle nodes unevenly)."""
    stride = math.prod(getattr(par, d) for d in DIMS[:DIMS.index(dim)])
    size = getattr(par, dim)
    if stride * size <= gpus_per_node:
        return size if gpus_per_node % (stride * size) == 0 else 1
    return gpus_per_node // stride if gpus_per_node % stride == 0 and stride < gpus_per_node else 1


def link(dim: str, par: Parallel, cluster: Cluster, point_to_point: bool = False) -> tuple[float, float]:
    """(bytes/s, latency s) of one member of group `dim`, from where its members sit."""
    k, size = members_per_node(dim, par, cluster.gpus_per_node), getattr(par, dim)
    if point_to_point:                    # the link model is minitron/hardware.py's
        return point_to_point_link(cluster.gpu, crosses_nodes=k < size)
    return ring_link(cluster.gpu, size, k)


def layer_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, seq: int, moe: bool) -> dict:
    """One layer, one micro-batch, one rank: seconds by term (forward + backward + recompute)."""
    g, t, b = cluster.gpu, par.tp, par.micro_batch
    s_loc = seq // par.cp
    rows, h, d = b * s_loc, cfg.hidden, cfg.head_dim
    q, kv = cfg.n_heads * d, cfg.kv_heads * d
    heads = cfg.n_heads // t
    mats = 2 if cfg.activation == "swiglu" else 1
    dense = [_linear_seconds(rows, (q + 2 * kv) // t, h, g), _linear_seconds(rows, h, q // t, g)]
    mlp_rows = rows * cfg.topk if moe else rows     # tokens this rank's experts take, on average
    mlp = [_linear_seconds(mlp_rows, mats * cfg.ffn // t, h, g), _linear_seconds(mlp_rows, h, cfg.ffn // t, g)]
    core = [_linear_seconds(s_loc, seq, d, g, b * heads), _linear_seconds(s_loc, d, seq, g, b * heads)]
    fwd = lambda parts: sum(f for f, _ in parts)
    bwd = lambda parts: sum(w for _, w in parts)
    redo = {"none": 0.0, "selective": fwd(core), "full": fwd(dense + mlp + core)}[par.recompute]
    compute = fwd(dense + mlp + core) + bwd(dense + mlp + core) + redo

    E, S = rows * h, b * heads * s_loc * seq
    R = E / t if par.sp else E
    ew_fwd_core, ew_fwd_rest = 9 * S, 22 * R + 16 * E * (mlp_rows / rows) / t
    passes = {"none": 3, "selective": 3, "full": 4}[par.recompute]      # fwd, bwd (2x), [fwd]
    core_passes = 4 if par.recompute != "none" else 3
    memory_bound = (passes * ew_fwd_rest + core_passes * ew_fwd_core) / (g.hbm_bw * g.hbm_eff)

    n_ar = 6 if par.recompute == "full" else 4
    tp = n_ar * ring_seconds(2 * E, t, link("tp", par, cluster))
    cp = 0.0
    if par.cp > 1:
        kv_bytes = 2 * b * s_loc * 2 * kv // t
        send = 3 * (par.cp - 1) * kv_bytes / link("cp", par, cluster, True)[0]
        cp = max(0.0, send - (fwd(core) + bwd(core)))
    ep = 0.0
    if moe and par.ep > 1:
        bw, lat = link("ep", par, cluster, point_to_point=True)   # all-to-all: own NIC
        a2a = (par.ep - 1) / par.ep * 2 * rows * cfg.topk * h / (t if par.sp else 1) / bw + lat
        ep = (6 if par.recompute == "full" else 4) * a2a
    return {"compute": compute, "memory-bound ops": memory_bound, "TP comm": tp, "CP comm": cp,
            "EP comm": ep}


def _head_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, seq: int) -> dict:
    """The embedding and output layer of one micro-batch (on the first and last stage)."""
    g, rows = cluster.gpu, par.micro_batch * seq // par.cp
    f, w = _linear_seconds(rows, cfg.vocab_size // par.tp, cfg.hidden, g)
    cross_entropy = 12 * rows * cfg.vocab_size / par.tp / (g.hbm_bw * g.hbm_eff)
    tp = 2 * ring_seconds(2 * rows * cfg.hidden, par.tp, link("tp", par, cluster))
    return {"compute": f + w, "memory-bound ops": cross_entropy, "TP comm": tp}


def dense_params_per_rank(cfg: ModelConfig, par: Parallel) -> float:
    """Parameters one rank holds (12h^2 per layer, experts over ep, + the embedding on its stage)."""
    h, layers = cfg.hidden, cfg.n_layers / par.pp
    attn = 2 * h * (cfg.n_heads + cfg.kv_heads) * cfg.head_dim
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.ffn
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) / par.pp if cfg.n_experts else 0
    per_rank = layers * attn + (layers - n_moe) * mlp + n_moe * mlp * cfg.n_experts / par.ep
    return per_rank / par.tp + cfg.vocab_size * h / par.tp


def step_time(cfg: ModelConfig, par: Parallel, cluster: Cluster, global_batch: int,
              seq: int | None = None, software: str = "megatron-core") -> Breakdown:
    """The predicted step, by term (see the module docstring)."""
    seq = seq or cfg.seq_len
    g, sw = cluster.gpu, SOFTWARE[software]
    m = global_batch // (par.dp * par.ep * par.micro_batch)
    if m < 1 or global_batch % (par.dp * par.ep * par.micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of dp*ep*micro_batch = "
                         f"{par.dp * par.ep * par.micro_batch}")
    layers = cfg.n_layers // par.pp                 # rank 0's layers, MoE every k-th
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers)) if cfg.n_experts else 0
    per_stage = {k: (layers - n_moe) * v for k, v in layer_seconds(cfg, par, cluster, seq, False).items()}
    if n_moe:
        for k, v in layer_seconds(cfg, par, cluster, seq, True).items():
            per_stage[k] += n_moe * v
    head = _head_seconds(cfg, par, cluster, seq)
    busiest = dict(per_stage)                       # the stage with the output layer (and embedding)
    for k, v in head.items():
        busiest[k] += v
    terms = {k: m * v for k, v in busiest.items()}

    stage = sum(per_stage.values())
    terms["bubble"] = SCHEDULE_BUBBLE[par.schedule] * (par.pp - 1) / par.virtual * stage
    terms["PP send/recv"] = 0.0
    if par.pp > 1:
        msg = 2 * par.micro_batch * seq // par.cp * cfg.hidden / par.tp
        bw, lat = link("pp", par, cluster, point_to_point=True)
        terms["PP send/recv"] = m * par.virtual * 2 * (msg / bw + lat)
    psi = dense_params_per_rank(cfg, par)
    grad_sync = ring_seconds(2 * psi, par.dp * par.cp, link("dp", par, cluster)) * (1.5 if par.zero == 3 else 1)
    if par.pp == 1 and sw.overlap_dp:                # buckets overlap the last micro-batch's backward
        window = sum(v for k, v in busiest.items() if k == "compute") * 2 / 3
        grad_sync = max(0.0, grad_sync - window) + grad_sync / 25   # the last bucket (~25 buckets)
    terms["DP comm"] = grad_sync
    terms["grad accumulation"] = 0.0 if sw.accumulation_fusion else m * 10 * psi / (g.hbm_bw * g.hbm_eff)
    shard = par.dp * par.cp if par.zero >= 1 else 1
    terms["optimizer"] = ADAM_BYTES * psi / shard / (g.hbm_bw * g.hbm_eff)

    flops = iteration_flops(cfg, global_batch, seq, par.recompute)
    model_flops = iteration_flops(cfg, global_batch, seq, "none")
    return Breakdown(terms, m, flops, model_flops, par.gpus, global_batch * seq, g.peak_flops)
