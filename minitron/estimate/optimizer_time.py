"""The weight-update terms of one step: the data-parallel gradient reduction, the gradient
accumulation and the optimizer step, from the parameters one rank holds.

  DP          the gradients (2 bytes each, 4 where the software reduces them in fp32) all-reduced
              once per step; under ZeRO-1/2 (Megatron's distributed optimizer, Llama 3's FSDP) the
              gradients are reduce-scattered at those bytes and the updated 16-bit parameters
              all-gathered (2 bytes each: Megatron-Core's param buffers hold the model's dtype,
              FSDP gathers in its 16-bit param_dtype); over dp x cp x ep ranks for the dense
              weights (every rank that holds the same dense shard) and dp x cp for the experts. ZeRO-3 (FSDP)
              instead gathers the parameters before each micro-batch's forward and again
              before its backward and reduce-scatters its gradients: 3 collectives per
              micro-batch, each overlapped with that micro-batch's compute when the software
              overlaps DP. Otherwise overlapped (if at all) with the last micro-batch's backward.
  optimizer   Megatron's mixed-precision step over the rank's fp32 master shard, at HBM speed
              (megatron/optimizer/optimizer.py, step()): the 16-bit gradients copied into fp32
              main grads (read 2, write 4; not where the gradients are accumulated in fp32
              already), unscaled and checked for inf (read 4, write 4), their norm for clipping
              (read 4), Adam (read parameter, m, v, gradient: 16; write parameter, m, v: 12), the
              parameters copied back to 16 bits (read 4, write 2): 52 bytes per parameter, 46
              with fp32 main grads. minitron's engine steps torch's AdamW on its parameters:
              Adam's 28 bytes alone.
  grad accumulation  without Megatron's gradient-accumulation fusion (the weight-gradient GEMM
              adding into the fp32 main grad, 2022), each micro-batch's 16-bit weight gradient
              is added to it afterwards: 10 bytes per parameter per micro-batch at HBM speed.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hardware import ring_seconds
from .devices import link
from .parallel import Cluster, Parallel
from .shape import expert_ffn, mlp_matrices, shared_experts
from .software import Software

ADAM_BYTES = 16 + 12                             # read parameter, m, v, gradient; write parameter, m, v
OPTIMIZER_BYTES = 4 + 4 + 4 + ADAM_BYTES + 4 + 2  # unscale+inf check, norm, Adam, copy back (docstring)
GRAD_TO_FP32_BYTES = 2 + 4                       # the 16-bit gradient copied into the fp32 main grad


def params_per_rank(cfg: ModelConfig, par: Parallel) -> tuple[float, float]:
    """(dense, expert) parameters one rank holds: attention and dense MLPs, the experts over ep,
    over tp; the embedding on its stage."""
    h, layers = cfg.hidden, par.stage_layers(cfg.n_layers) if par.trim else cfg.n_layers / par.pp
    attn = h * (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.n_heads * cfg.head_dim * h
    mlp = mlp_matrices(cfg) * h * cfg.ffn
    expert = mlp_matrices(cfg) * h * expert_ffn(cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) / cfg.n_layers * layers if cfg.n_experts else 0
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_embeddings or par.pp > 1 else 2)
    dense = layers * attn + (layers - n_moe) * mlp + n_moe * shared_experts(cfg) * expert + embeddings
    return dense / par.tp, n_moe * expert * cfg.n_experts / par.ep / par.tp


def dense_params_per_rank(cfg: ModelConfig, par: Parallel) -> float:
    """All the parameters one rank holds (dense and its experts)."""
    return sum(params_per_rank(cfg, par))


def dp_seconds(cfg, par, cluster, sw, m, compute_mb) -> float:
    """The data-parallel collectives of one step, as much of them as shows (module docstring)."""
    dense, expert = params_per_rank(cfg, par)
    groups = ((dense, par.dp * par.cp * par.ep), (expert, par.dp * par.cp))
    bw_lat = link("dp", par, cluster)
    gbytes, base = sw.grad_reduce_bytes, cluster.gpu.collective_latency
    if par.zero == 3:            # per micro-batch: gather (fwd), gather (bwd), reduce-scatter
        per_mb = sum(2 * ring_seconds(2 * psi, n, bw_lat, 1, base) + ring_seconds(gbytes * psi, n, bw_lat, 1, base)
                     for psi, n in groups if psi)
        if sw.overlap_dp:
            return m * (max(0.0, per_mb - compute_mb) + per_mb / 25)
        return m * per_mb
    if par.zero in (1, 2):       # gradients reduce-scattered at their bytes, 16-bit parameters all-gathered
        sync = sum(ring_seconds(gbytes * psi, n, bw_lat, 1, base) + ring_seconds(2 * psi, n, bw_lat, 1, base)
                   for psi, n in groups if psi)
    else:                        # one all-reduce of the gradients, both phases at their bytes
        sync = sum(ring_seconds(gbytes * psi, n, bw_lat, base=base) for psi, n in groups if psi)
    if sw.overlap_dp and (par.pp == 1 or sw.overlap_dp_with_pipeline):
        window = compute_mb * 2 / 3          # the last micro-batch's backward
        return max(0.0, sync - window) + sync / 25   # and its last bucket (~25 buckets)
    return sync


def accumulation_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, sw: Software,
                         microbatches: int) -> float:
    """Each micro-batch's 16-bit weight gradient added into the fp32 main grad (none when the
    wgrad GEMM accumulates there itself)."""
    g = cluster.gpu
    if sw.accumulation_fusion:
        return 0.0
    return microbatches * 10 * dense_params_per_rank(cfg, par) / (g.hbm_bw * g.hbm_eff)


def optimizer_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, sw: Software) -> float:
    """The optimizer step over this rank's shard of the master weights (all of them without ZeRO)."""
    g = cluster.gpu
    shard = par.dp * par.cp if par.zero >= 1 else 1
    per_param = ADAM_BYTES
    if sw.megatron_optimizer:
        per_param = OPTIMIZER_BYTES + (0 if sw.accumulation_fusion else GRAD_TO_FP32_BYTES)
    return per_param * dense_params_per_rank(cfg, par) / shard / (g.hbm_bw * g.hbm_eff)
