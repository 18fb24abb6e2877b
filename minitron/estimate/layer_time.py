"""One layer of one micro-batch on one rank, term by term: compute, the memory-bound kernels
between the GEMMs, and the TP, CP and EP collectives (forward, backward and recomputation).
time_model.step_time multiplies it by a stage's layers and micro-batches.

  compute     every matrix multiplication of the layer (QKV, out-projection, fc1, fc2, the
              attention core's two batched products), forward, backward (the input's gradient
              and the weight's: two GEMMs of the forward's size) and the recomputation
              (full: the forward again; selective: the core again). A GEMM's time is the
              larger of its FLOPs at the achieved matmul rate and its bytes at HBM speed, its
              FLOP rate cut by wave quantization: its 128x128 output tiles fill the GPU's
              SMs in whole waves, and a last partial wave runs at the cost of a full one.
  memory-bound the kernels between the GEMMs, as Megatron fuses them (2-byte activations):
              per forward 22 R (two LayerNorms: 4 R each; two bias-dropout-adds: read 2, read
              residual 2, write 2, 1-byte mask) + 4 E f/(h t) (bias-GeLU on the f = 4h hidden:
              read f, write f; SwiGLU reads 2f: 6 E f/(h t)) + 9 S
              (fused scale-mask-softmax 4 S, dropout 5 S) bytes, with E = b s h, R = E (E/t under
              SP), S = b (a/t) s^2, + 4 E/t without flash attention: the context copied back from
              [b, a/t, s, d] to [s, b, h/t] (Megatron's core attention, permute(2, 0, 1, 3)
              .contiguous(): megatron/model/transformer.py of NVIDIA/Megatron-LM a0368ddf47 (2019),
              de7dc40f88 (Aug 2021, examples/sc21's commit) and 2755bcb87b (Jun 2022); minitron's
              transpose + reshape, model/blocks.py); the backward moves twice the forward's bytes
              outside the core (LayerNorm's reads x and dy, writes dx, and reads both again for its
              weights' gradients; bias-GeLU's reads x and dy, writes dx) and 11 S in the core: the
              dropout's backward reads the gradient and the mask and writes (5 S), the softmax's
              reads its output and the gradient and writes (6 S), not twice the forward's 9 S.
  TP          per forward 2 all-reduces of 2E bytes (SP: 2 all-gathers + 2 reduce-scatters,
              the same bytes), 2 more in backward, 2 more when the forward is recomputed;
              a ring all-reduce moves 2(t-1)/t of the buffer at the group's bandwidth. The
              forward's are synchronous. The backward's, from megatron-2022 on, run beside the
              column-parallel linears' (QKV, fc1) GEMMs: without SP their dgrad all-reduce
              beside the wgrad GEMM; with SP the all-gather that is the reduce-scatter's
              backward stays exposed (one all-reduce's bytes per layer) and the re-gathered
              input and the dgrad reduce-scatter run beside the dgrad and wgrad GEMMs; only
              what exceeds those GEMMs shows. With TP overlap (Transformer Engine's
              userbuffers, inside a node only) the first of t chunks of each collective stays
              exposed and the rest hides behind the layer's linear GEMMs.
  CP          the ring passes K and V (cp-1) times forward, and K, V and their gradients
              backward; overlapped with the attention core, only the excess shows.
  EP          all-to-all dispatch and combine of the top-k tokens, forward and backward.
              Without Megatron's fused kernels (megatron-2019: NVIDIA/Megatron-LM a0368ddf47,
              Aug 2019, mpu/transformer.py and mpu/layers.py) each step is its own kernel, a
              read and a write of 2-byte elements: the scores scaled, multiplied by the mask,
              the mask's -10000 subtracted, softmax, dropout (+1-byte mask): 4+4+4+4+5 = 21 S;
              per residual branch RowParallelLinear's bias added after the all-reduce (4 E),
              dropout (5 E), the residual add (read 4, write 2) = 15 E against the fused 7.
              LayerNorm (apex's fused) and GeLU (torch.jit.script) were fused already.
Under flash attention (software.py) the core's s x s scores never reach HBM: no softmax/dropout
bytes, causal blocks skipped, its backward 2.5 forwards (Dao 2023, FlashAttention-2, §3.1: the
backward recomputes S and P, five matmuls against the forward's two), at the sustained matmul
rate unless the software's kernel has a published lower utilization on that GPU (software.py).
"""
from __future__ import annotations

from ..config import ModelConfig
from ..hardware import ring_seconds
from .devices import _linear_seconds, flash_attention_seconds, link, members_per_node
from .parallel import Cluster, Parallel
from .shape import expert_ffn, shared_experts
from .software import Software, software as named_software

FUSED_CORE_BYTES, UNFUSED_CORE_BYTES = 9, 4 + 4 + 4 + 4 + 5    # per score element, one forward
# per score element, one backward: dropout's (read the gradient 2 and the mask 1, write 2) and the
# softmax's (read its output and the gradient, write: 6); unfused, also the scaling's and the mask
# product's (read 2, write 2 each; the mask's constant term has no backward kernel)
FUSED_CORE_BWD_BYTES, UNFUSED_CORE_BWD_BYTES = 5 + 6, 5 + 6 + 4 + 4
FUSED_RESIDUAL_BYTES, UNFUSED_RESIDUAL_BYTES = 7, 4 + 5 + 6    # per element, one residual branch

def layer_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, seq: int, moe: bool,
                  sw: Software | None = None) -> dict:
    """One layer, one micro-batch, one rank: seconds by term (forward + backward + recompute)."""
    sw = sw or named_software("minitron")
    g, t, b = cluster.gpu, par.tp, par.micro_batch
    s_loc = seq // par.cp
    rows, h, d = b * s_loc, cfg.hidden, cfg.head_dim
    q, kv = cfg.n_heads * d, cfg.kv_heads * d
    heads = cfg.n_heads // t
    mats = 2 if cfg.activation == "swiglu" else 1
    qkv = [_linear_seconds(rows, (q + 2 * kv) // t, h, g)]
    proj = [_linear_seconds(rows, h, q // t, g)]
    mlp_rows = rows * cfg.topk if moe else rows     # tokens this rank's experts take, on average
    f = expert_ffn(cfg) if moe else cfg.ffn
    mlp = [_linear_seconds(mlp_rows, mats * f // t, h, g), _linear_seconds(mlp_rows, h, f // t, g)]
    if moe and shared_experts(cfg):                 # every token through the shared experts too
        n = shared_experts(cfg)
        mlp += [_linear_seconds(rows, n * mats * f // t, h, g), _linear_seconds(rows, h, n * f // t, g)]
    fwd = lambda parts: sum(x for x, _ in parts)
    bwd = lambda parts: sum(w for _, w in parts)
    if sw.flash_attention:       # causal tiles skipped (about half), backward 2.5 forwards (Dao 2023)
        core_fwd = flash_attention_seconds(s_loc, seq, d, g, b * heads, sw.attention_utilization(g))
        core = [(core_fwd, 2.5 * core_fwd)]
    else:
        core = [_linear_seconds(s_loc, seq, d, g, b * heads), _linear_seconds(s_loc, d, seq, g, b * heads)]
    dense = qkv + proj
    redo = {"none": 0.0, "selective": fwd(core), "full": fwd(dense + mlp + core)}[par.recompute]
    compute = fwd(dense + mlp + core) + bwd(dense + mlp + core) + redo

    E, S = rows * h, b * heads * s_loc * seq
    R = E / t if par.sp else E
    core_bytes, residual_bytes = ((FUSED_CORE_BYTES, FUSED_RESIDUAL_BYTES) if sw.fused_kernels
                                  else (UNFUSED_CORE_BYTES, UNFUSED_RESIDUAL_BYTES))
    ew_fwd_core = 0 if sw.flash_attention else core_bytes * S
    ew_bwd_core = 0 if sw.flash_attention else (FUSED_CORE_BWD_BYTES if sw.fused_kernels
                                                else UNFUSED_CORE_BWD_BYTES) * S
    visits = (mlp_rows / rows + shared_experts(cfg)) if moe else 1
    ew_fwd_rest = (2 * 4 + 2 * residual_bytes) * R + 2 * (mats + 1) * E * (f / h) * visits / t
    if not sw.flash_attention:
        ew_fwd_rest += 4 * E / t                    # the context made contiguous again (docstring)
    passes = {"none": 3, "selective": 3, "full": 4}[par.recompute]      # fwd, bwd (2x), [fwd]
    core_forwards = 2 if par.recompute != "none" else 1                 # fwd [, recomputed fwd]
    memory_bound = (passes * ew_fwd_rest + core_forwards * ew_fwd_core + ew_bwd_core) / (g.hbm_bw * g.hbm_eff)

    n_ar = 6 if par.recompute == "full" else 4
    one = ring_seconds(2 * E, t, link("tp", par, cluster), base=cluster.gpu.collective_latency)
    tp = n_ar * one
    inside = members_per_node("tp", par, cluster.gpus_per_node) >= t
    if sw.overlap_tp and t > 1 and inside:   # chunked collective-GEMM pipelines: the first of t chunks shows
        linear = fwd(dense + mlp) * (2 if par.recompute == "full" else 1) + bwd(dense + mlp)
        tp = tp / t + max(0.0, tp * (t - 1) / t - linear)
    elif sw.async_tp_backward and t > 1:      # the backward's collectives beside the column linears' GEMMs
        column_bwd = qkv[0][1] + mlp[0][1]    # their dgrad + wgrad GEMMs (equal FLOPs)
        if par.sp:       # exposed: the reduce-scatters' backward all-gathers (one all-reduce's bytes)
            tp = (n_ar - 1) * one + max(0.0, 2 * one - column_bwd)
        else:            # the dgrad all-reduces beside the wgrad GEMMs alone
            tp = (n_ar - 2) * one + max(0.0, 2 * one - column_bwd / 2)
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


def head_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, seq: int) -> dict:
    """The embedding and output layer of one micro-batch (on the first and last stage)."""
    g, rows = cluster.gpu, par.micro_batch * seq // par.cp
    f, w = _linear_seconds(rows, cfg.vocab_size // par.tp, cfg.hidden, g)
    cross_entropy = 12 * rows * cfg.vocab_size / par.tp / (g.hbm_bw * g.hbm_eff)
    tp = 2 * ring_seconds(2 * rows * cfg.hidden, par.tp, link("tp", par, cluster), base=cluster.gpu.collective_latency)
    return {"compute": f + w, "memory-bound ops": cross_entropy, "TP comm": tp}
