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
              residual 2, write 2, 1-byte mask) + 4 E f/(h t) (bias-GeLU on the f = 4h hidden:
              read f, write f; SwiGLU reads 2f: 6 E f/(h t)) + 9 S
              (fused scale-mask-softmax 4 S, dropout 5 S) bytes, with E = b s h, R = E (E/t under
              SP), S = b (a/t) s^2; backward moves twice the forward's bytes.
  TP          per forward 2 all-reduces of 2E bytes (SP: 2 all-gathers + 2 reduce-scatters,
              the same bytes), 2 more in backward, 2 more when the forward is recomputed;
              a ring all-reduce moves 2(t-1)/t of the buffer at the group's bandwidth. The
              forward's are synchronous. The backward's, from megatron-2022 on, run beside the
              column-parallel linears' (QKV, fc1) GEMMs: without SP their dgrad all-reduce
              beside the wgrad GEMM; with SP the all-gather that is the reduce-scatter's
              backward stays exposed (one all-reduce's bytes per layer) and the re-gathered
              input and the dgrad reduce-scatter run beside the dgrad and wgrad GEMMs; only
              what exceeds those GEMMs shows.
  CP          the ring passes K and V (cp-1) times forward, and K, V and their gradients
              backward; overlapped with the attention core, only the excess shows.
  EP          all-to-all dispatch and combine of the top-k tokens, forward and backward.
Per step:
  bubble      (p-1)/v stage-times idle (1F1B, GPipe; interleaved divides by v; ZB-H1 a third)
  uneven      Parallel.trim: the first and last stage hold `trim` layers fewer than the middle
              ones (Llama 3, Dubey et al. 2024, §3.3.2: one layer fewer on each, to balance the
              embedding and the output layer); the slowest stage sets the step
  PP          each micro-batch's activation and gradient cross each stage boundary (v times
              per rank with interleaving), exposed: split over tp under SP; without SP,
              Megatron 2021-22's scatter/gather sends 1/tp and all-gathers it over the TP group
              on arrival; later software (and minitron) sends the whole activation
  DP          the gradients (2 bytes each) reduce-scattered and all-gathered (an all-reduce's
              bytes), once per step, over dp x cp x ep ranks for the dense weights (every rank
              that holds the same dense shard) and dp x cp for the experts. ZeRO-3 (FSDP)
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

Which software runs decides several of these (software.py, one named feature set per release):
flash attention (the core's s x s scores never reach HBM: no softmax/dropout bytes, causal
blocks skipped, its backward 2.5 forwards: Dao 2023, FlashAttention-2, §3.1: the backward
recomputes S and P, five matmuls against the forward's two); TP communication overlapped with
the GEMMs (the first of t chunks of each collective stays exposed, the rest hides behind the
layer's linear GEMMs; only inside a node, where Transformer Engine's userbuffers run); the data-parallel reduction overlapped with the last micro-batch's
backward; gradient-accumulation fusion; the bytes of a reduced gradient.

A group's bandwidth is minitron/hardware.py's link model: inside a node, NVLink's; a ring
collective that crosses nodes with k members per node gets k NICs' worth (NCCL's rings leave the
node once per NIC), at most NVLink's; a send (PP) or an all-to-all (EP) leaves through the GPU's
own NIC. Members per node follow the tp-cp-ep-dp-pp rank layout of minitron/grid/ (tp fastest).
Latency is alpha-beta per ring step: a ring collective of n ranks takes n - 1 steps per phase and
pays the link's latency (hardware.GPU.*_latency, one hop's) at each, so it grows linearly with the
group as NCCL's ring algorithm does.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from .flops import iteration_flops
from ..hardware import GPU, ring_seconds
from .devices import _linear_seconds, gemm_seconds, link, members_per_node   # gemm_seconds: lesson 13 imports it here
from .shape import expert_ffn, mlp_matrices, shared_experts
from .software import SOFTWARE, Software, software as named_software

SCHEDULE_BUBBLE = {"1f1b": 1.0, "gpipe": 1.0, "interleaved": 1.0, "zb-h1": 1 / 3}
ADAM_BYTES = 16 + 12                             # read parameter, m, v, gradient; write parameter, m, v
OPTIMIZER_BYTES = 4 + 4 + 4 + ADAM_BYTES + 4 + 2  # unscale+inf check, norm, Adam, copy back (docstring)
GRAD_TO_FP32_BYTES = 2 + 4                       # the 16-bit gradient copied into the fp32 main grad


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
    trim: int = 0               # uneven stages: the first and last stage hold `trim` layers fewer

    def stage_layers(self, n_layers: int) -> int:
        """Layers of a middle stage: (n + 2 trim) / pp (all stages equal when trim is 0)."""
        return (n_layers + 2 * self.trim) // self.pp

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp * self.ep

    def label(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        if self.virtual > 1:
            parts.append(f"v{self.virtual}")
        parts += [f"dp{self.dp}"] + [f"{d}{getattr(self, d)}" for d in ("cp", "ep") if getattr(self, d) > 1]
        parts += [f"trim{self.trim}"] if self.trim else []
        parts += [f"mb{self.micro_batch}", f"zero{self.zero}", self.recompute, self.schedule]
        return " ".join(parts)


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
        core_fwd = (gemm_seconds(s_loc, seq, d, g, b * heads) + gemm_seconds(s_loc, d, seq, g, b * heads)) / 2
        core = [(core_fwd, 2.5 * core_fwd)]
    else:
        core = [_linear_seconds(s_loc, seq, d, g, b * heads), _linear_seconds(s_loc, d, seq, g, b * heads)]
    dense = qkv + proj
    redo = {"none": 0.0, "selective": fwd(core), "full": fwd(dense + mlp + core)}[par.recompute]
    compute = fwd(dense + mlp + core) + bwd(dense + mlp + core) + redo

    E, S = rows * h, b * heads * s_loc * seq
    R = E / t if par.sp else E
    ew_fwd_core = 0 if sw.flash_attention else 9 * S
    visits = (mlp_rows / rows + shared_experts(cfg)) if moe else 1
    ew_fwd_rest = 22 * R + 2 * (mats + 1) * E * (f / h) * visits / t
    passes = {"none": 3, "selective": 3, "full": 4}[par.recompute]      # fwd, bwd (2x), [fwd]
    core_passes = 4 if par.recompute != "none" else 3
    memory_bound = (passes * ew_fwd_rest + core_passes * ew_fwd_core) / (g.hbm_bw * g.hbm_eff)

    n_ar = 6 if par.recompute == "full" else 4
    one = ring_seconds(2 * E, t, link("tp", par, cluster))
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


def _head_seconds(cfg: ModelConfig, par: Parallel, cluster: Cluster, seq: int) -> dict:
    """The embedding and output layer of one micro-batch (on the first and last stage)."""
    g, rows = cluster.gpu, par.micro_batch * seq // par.cp
    f, w = _linear_seconds(rows, cfg.vocab_size // par.tp, cfg.hidden, g)
    cross_entropy = 12 * rows * cfg.vocab_size / par.tp / (g.hbm_bw * g.hbm_eff)
    tp = 2 * ring_seconds(2 * rows * cfg.hidden, par.tp, link("tp", par, cluster))
    return {"compute": f + w, "memory-bound ops": cross_entropy, "TP comm": tp}


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


def _dp_seconds(cfg, par, cluster, sw, m, compute_mb) -> float:
    """The data-parallel collectives of one step, as much of them as shows (module docstring)."""
    dense, expert = params_per_rank(cfg, par)
    groups = ((dense, par.dp * par.cp * par.ep), (expert, par.dp * par.cp))
    bw_lat = link("dp", par, cluster)
    gbytes = sw.grad_reduce_bytes
    if par.zero == 3:            # per micro-batch: gather (fwd), gather (bwd), reduce-scatter
        per_mb = sum(ring_seconds(2 * psi, n, bw_lat, 1) * 2 + ring_seconds(gbytes * psi, n, bw_lat, 1)
                     for psi, n in groups if psi)
        if sw.overlap_dp:
            return m * (max(0.0, per_mb - compute_mb) + per_mb / 25)
        return m * per_mb
    sync = sum(ring_seconds(gbytes * psi, n, bw_lat) for psi, n in groups if psi)
    if sw.overlap_dp and (par.pp == 1 or sw.overlap_dp_with_pipeline):
        window = compute_mb * 2 / 3          # the last micro-batch's backward
        return max(0.0, sync - window) + sync / 25   # and its last bucket (~25 buckets)
    return sync


def _pp_exchange_seconds(cfg, par, cluster, sw, seq) -> float:
    """One activation (or its gradient) across a stage boundary, exposed. Under SP it is already
    split over tp; without SP, Megatron's scatter/gather (megatron/p2p_communication.py, 2021-22)
    sends 1/tp of it and all-gathers it over the TP group on arrival (gather_split_1d_tensor, on
    the critical path); without that optimisation every TP rank sends the whole activation."""
    full = 2 * par.micro_batch * seq // par.cp * cfg.hidden
    split = par.sp or sw.pp_scatter_gather
    bw, lat = link("pp", par, cluster, point_to_point=True)
    send = (full / par.tp if split else full) / bw + lat
    if sw.pp_scatter_gather and not par.sp:
        send += ring_seconds(full, par.tp, link("tp", par, cluster), phases=1)
    return send


def step_time(cfg: ModelConfig, par: Parallel, cluster: Cluster, global_batch: int,
              seq: int | None = None, software: str = "minitron") -> Breakdown:
    """The predicted step, by term (see the module docstring), under the named software."""
    seq = seq or cfg.seq_len
    g, sw = cluster.gpu, named_software(software)
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
    head = _head_seconds(cfg, par, cluster, seq)
    busiest = stage_terms(layers - par.trim)        # the stage with the output layer (and embedding)
    for k, v in head.items():
        busiest[k] += v
    if sum(per_stage.values()) > sum(busiest.values()):
        busiest = per_stage                         # uneven stages: a middle stage is the slowest
    terms = {k: m * v for k, v in busiest.items()}

    stage = sum(per_stage.values())
    terms["bubble"] = SCHEDULE_BUBBLE[par.schedule] * (par.pp - 1) / par.virtual * stage
    exchange = _pp_exchange_seconds(cfg, par, cluster, sw, seq) if par.pp > 1 else 0.0
    terms["PP send/recv"] = m * par.virtual * 2 * exchange
    psi = dense_params_per_rank(cfg, par)
    terms["DP comm"] = _dp_seconds(cfg, par, cluster, sw, m, busiest["compute"])
    terms["grad accumulation"] = 0.0 if sw.accumulation_fusion else m * 10 * psi / (g.hbm_bw * g.hbm_eff)
    shard = par.dp * par.cp if par.zero >= 1 else 1
    per_param = ADAM_BYTES
    if sw.megatron_optimizer:
        per_param = OPTIMIZER_BYTES + (0 if sw.accumulation_fusion else GRAD_TO_FP32_BYTES)
    terms["optimizer"] = per_param * psi / shard / (g.hbm_bw * g.hbm_eff)

    flops = iteration_flops(cfg, global_batch, seq, par.recompute)
    model_flops = iteration_flops(cfg, global_batch, seq, "none")
    return Breakdown(terms, m, flops, model_flops, par.gpus, global_batch * seq, g.peak_flops)
