"""Where one rank's memory goes in a training step, by component.

For a model (a named preset or explicit sizes) and a configuration (tp, sp, pp, virtual
chunks, schedule, dp, cp, micro-batch, sequence, ZeRO stage, recomputation, dtype) it
predicts the bytes of the FIRST pipeline rank (it holds the embedding and, under 1F1B-like
schedules, the most micro-batches in flight):

  parameters, gradients, optimizer state
      the rank's parameter count Ψ from the same rules that shard the model
      (model/convert.py: tp splits, pipeline stages), times bytes per parameter, sharded
      over dp by ZeRO stage as in the ZeRO paper (data_parallel/memory.py formula_bytes):
      float32 keeps 4 (params) + 4 (grads) + 8 (Adam's two moments) bytes per parameter,
      bfloat16/float16 mixed precision 2 + 2 + 12 (an fp32 master copy and two moments);
      `grad_dtype="float32"` keeps the gradients in fp32 as Megatron-LM does (its main_grad
      buffer: 2 + 4 + 12 = 18 bytes per parameter, 6 + 12/d with the distributed optimizer,
      the table of Megatron-LM's docs/source/api-guide/distrib_optimizer.md);
      ZeRO-2's gradients are 2Ψ/N only when each micro-batch's gradients are reduce-scattered
      at once (`zero2_sync="each"`, DeepSpeed's way, m times the reduce-scatter traffic); minitron
      accumulates a step's micro-batches in the full buffer under no_sync and reduce-scatters
      after the last (`"last"`, the default), so with more than one micro-batch per step (any
      pipeline) its peak holds the full 2Ψ;
  activations
      activations.layer_bytes per layer (Korthikanti et al.'s terms; minitron's float32
      accounting when dtype is float32) x the rank's layers x the micro-batches it keeps in
      flight at its peak, which pipeline.check reads off the schedule (1F1B: pp; GPipe: m;
      interleaved: its chunks' fractions); with full recomputation, plus the working set of the
      one layer being recomputed. Context parallelism gives each rank s/cp tokens (its
      queries still meet all s keys: the scores term is s/cp x s).

`regather` counts sequence parallelism as Megatron runs it (the QKV and fc1 inputs kept as
the rank's shard and all-gathered again in backward), Korthikanti et al.'s accounting;
minitron keeps them gathered (the default here, what its model measures).

Not counted: the embedding's and output layer's activations (the logits and the loss),
temporary buffers, allocator fragmentation and the CUDA context: the total is a floor.
Experts: each MoE layer's experts are split over ep (and tp) ranks, so a rank holds
n_experts/ep of them; their gradients and optimizer state are sharded by ZeRO over the ranks
holding the same experts (dp), the dense weights' over dp x ep (minitron/grid/'s dense_dp). A MoE
layer's MLP hidden activations count topk times (each token visits topk experts; on average a
rank's experts take b s topk tokens whatever ep is); the router's are not counted.
"""
from __future__ import annotations

import dataclasses
import functools

from ..data_parallel.memory import formula_bytes
from ..config import ModelConfig
from ..pipeline.check import check
from ..pipeline.schedules import SCHEDULES, make_schedule
from .activations import MINITRON, PAPER, RECOMPUTE, layer_bytes, layer_terms
from .params import rank_params, rank_params_split   # rank_params: lessons 13, 14 import it from here
from .shape import MODERN, expert_ffn, shared_experts

_GPT2 = dict(vocab_size=50257, seq_len=1024, tie_embeddings=True)
_MEGATRON = dict(vocab_size=51200, seq_len=2048, tie_embeddings=True)
PRESETS = {
    "gpt2-small": ModelConfig(hidden=768, n_layers=12, n_heads=12, **_GPT2),
    "gpt2-medium": ModelConfig(hidden=1024, n_layers=24, n_heads=16, **_GPT2),
    "gpt2-large": ModelConfig(hidden=1280, n_layers=36, n_heads=20, **_GPT2),
    "gpt2-xl": ModelConfig(hidden=1600, n_layers=48, n_heads=25, **_GPT2),
    "gpt3-175b": ModelConfig(hidden=12288, n_layers=96, n_heads=96, **_MEGATRON),
    "1t": ModelConfig(hidden=25600, n_layers=128, n_heads=160, **_MEGATRON),   # Narayanan et al.
    **MODERN,                                                                   # shape.py: sources
}
ZERO2_SYNC = ("last", "each")   # when ZeRO-2 reduce-scatters: after a step's last micro-batch, or each
DTYPES = {"float32": (4, 4, 8, MINITRON), "bfloat16": (2, 2, 12, PAPER), "float16": (2, 2, 12, PAPER)}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)} "
                         "or give --layers/--hidden/--heads")
    return PRESETS[name]


@dataclasses.dataclass(frozen=True)
class Setup:
    tp: int = 1
    sp: bool = False
    regather: bool = False            # Megatron's SP: keep the QKV/fc1 inputs' shard, re-gather
    pp: int = 1
    virtual: int = 1
    schedule: str | None = None       # default: 1f1b (interleaved when virtual > 1)
    microbatches: int | None = None   # per iteration; default: pp
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    seq: int | None = None            # default: the model's seq_len
    zero: int = 0
    recompute: str = "none"
    dtype: str = "bfloat16"
    zero2_sync: str = "last"          # ZeRO-2 under accumulation: "last" (minitron) or "each"
    grad_dtype: str | None = None     # None: dtype's own; "float32": Megatron's fp32 main grads
    flash_attention: bool = False     # no s x s scores kept (activations.py)


@dataclasses.dataclass(frozen=True)
class Estimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    in_flight: float                 # micro-batches of a full stage alive at the peak
    layers: int                      # layers on this rank
    layer_activation_bytes: int      # one layer, one micro-batch
    recompute_working_set: int       # full recompute: one layer's activations, rebuilt

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def components(self) -> dict[str, int]:
        return {"parameters": self.params, "gradients": self.grads,
                "optimizer state": self.optimizer, "activations": self.activations}


def _validate(cfg: ModelConfig, su: Setup) -> None:
    for name in ("tp", "pp", "virtual", "dp", "cp", "ep", "micro_batch"):
        if type(getattr(su, name)) is not int or getattr(su, name) < 1:
            raise ValueError(f"{name} must be a positive integer, got {getattr(su, name)!r}")
    if su.ep > 1 and not cfg.n_experts:
        raise ValueError(f"ep={su.ep} splits experts, but the model has none: use ep=1 "
                         "(or give the model experts)")
    if cfg.n_experts and cfg.n_experts % su.ep:
        raise ValueError(f"{cfg.n_experts} experts cannot be split evenly over ep={su.ep}: "
                         f"choose ep dividing {cfg.n_experts}")
    if su.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {su.zero!r}")
    if su.dtype not in DTYPES:
        raise ValueError(f"dtype={su.dtype!r}: choose one of {', '.join(DTYPES)}")
    if su.grad_dtype not in (None, *DTYPES):
        raise ValueError(f"grad_dtype={su.grad_dtype!r}: choose one of {', '.join(DTYPES)} "
                         "(or None: the dtype's own)")
    if su.zero2_sync not in ZERO2_SYNC:
        raise ValueError(f"zero2_sync={su.zero2_sync!r}: choose one of {', '.join(ZERO2_SYNC)}")
    if su.recompute not in RECOMPUTE:
        raise ValueError(f"recompute={su.recompute!r}: choose one of {RECOMPUTE}")
    if su.sp and su.tp == 1:
        raise ValueError("sequence parallelism needs tp > 1: set tp >= 2 or drop sp")
    if su.regather and not su.sp:
        raise ValueError("regather (Megatron's all-gather again in backward) exists only under "
                         "sequence parallelism: add sp or drop regather")
    if cfg.n_layers % (su.pp * su.virtual):
        raise ValueError(f"{cfg.n_layers} layers cannot be cut into pp*virtual={su.pp * su.virtual} "
                         "equal stages: choose a divisor of the layer count")
    seq = su.seq or cfg.seq_len
    if seq % su.cp:
        raise ValueError(f"context parallelism splits the {seq} tokens across cp={su.cp}: "
                         f"choose a sequence length divisible by {su.cp}")


def microbatches_per_step(su: Setup) -> int:
    return su.microbatches or su.pp * (2 if su.virtual > 1 else 1)


def in_flight(su: Setup) -> float:
    """Micro-batches (in full-stage units) pipeline rank 0 keeps alive at its peak."""
    if su.pp == 1 and su.virtual == 1:
        return 1.0                       # gradient accumulation: one micro-batch at a time
    name = su.schedule or ("interleaved" if su.virtual > 1 else "1f1b")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    m, p, v = microbatches_per_step(su), su.pp, su.virtual
    closed = closed_form_peak(name, p, m, v)
    return closed if closed is not None else _schedule_peak(name, p, m, v)


def closed_form_peak(name: str, pp: int, microbatches: int, virtual: int) -> float | None:
    """Rank 0's peak in flight, read off the schedules' warm-ups (tests check it against the
    simulation): 1F1B and ZB-H1 min(m, p); GPipe m; interleaved min(m v, 2(p-1) + (v-1)p + 1)
    chunk-micro-batches, v of them a full stage. None for the others (simulated)."""
    if name in ("1f1b", "zb-h1"):
        return float(min(microbatches, pp))
    if name == "gpipe":
        return float(microbatches)
    if name == "interleaved":
        return min(microbatches * virtual, 2 * (pp - 1) + (virtual - 1) * pp + 1) / virtual
    return None


@functools.lru_cache(maxsize=256)
def _schedule_peak(name: str, pp: int, microbatches: int, virtual: int) -> float:
    """Checking a schedule simulates it (a second at pp=64): once per shape is enough."""
    return float(check(make_schedule(name, pp, microbatches, virtual)).peak_activations[0])


def shape_kwargs(cfg: ModelConfig, su: Setup) -> dict:
    """The model's shape as activations.layer_terms takes it (GQA, MLP width, SwiGLU, flash)."""
    return dict(kv_heads=cfg.kv_heads, ffn=cfg.ffn, swiglu=cfg.activation == "swiglu",
                flash=su.flash_attention)


def activation_bytes_per_layer(cfg: ModelConfig, su: Setup) -> int:
    """One layer, one micro-batch, on one rank (activations.py's terms; cp: s/cp tokens)."""
    seq = su.seq or cfg.seq_len
    precision = DTYPES[su.dtype][3]
    kwargs = dict(sp=su.sp, regather=su.regather, recompute=su.recompute, precision=precision,
                  **shape_kwargs(cfg, su))
    terms = layer_terms(su.micro_batch, seq // su.cp, cfg.hidden, cfg.n_heads, su.tp, **kwargs)
    if "attention scores" in terms:      # s/cp queries against all s keys
        terms["attention scores"] *= su.cp
    if cfg.n_experts and "MLP hidden (GeLU in, out)" in terms:   # MoE layers: topk (+ shared) visits
        moe_share = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) / cfg.n_layers
        visits = (cfg.topk + shared_experts(cfg)) * expert_ffn(cfg) / cfg.ffn
        terms["MLP hidden (GeLU in, out)"] = round(terms["MLP hidden (GeLU in, out)"]
                                                   * (1 + moe_share * (visits - 1)))
    return sum(terms.values())


def _state(psi: int, n: int, su: Setup, p_bytes: int, g_bytes: int, o_bytes: int):
    """Model-state bytes of psi parameters sharded by ZeRO over n ranks."""
    padded = -(-psi // n) * n                         # ZeRO pads each rank's share equally
    state = formula_bytes(padded if su.zero else psi, n, su.zero, p_bytes, g_bytes, o_bytes)
    if su.zero == 2 and su.zero2_sync == "last" and microbatches_per_step(su) > 1:
        state = dataclasses.replace(state, grads=g_bytes * padded)   # the full buffer accumulates
    return state


def estimate(cfg: ModelConfig, su: Setup = Setup()) -> Estimate:
    """Predicted bytes on pipeline rank 0 (one tp, cp and dp rank of it)."""
    _validate(cfg, su)
    p_bytes, g_bytes, o_bytes, precision = DTYPES[su.dtype]
    if su.grad_dtype:
        g_bytes = DTYPES[su.grad_dtype][1]
    dense, expert = rank_params_split(cfg, su.tp, su.pp, su.virtual, 0, su.ep)
    state = _state(dense, su.dp * su.ep, su, p_bytes, g_bytes, o_bytes)
    if expert:                                        # experts: sharded over their own dp group
        more = _state(expert, su.dp, su, p_bytes, g_bytes, o_bytes)
        state = dataclasses.replace(state, params=state.params + more.params,
                                    grads=state.grads + more.grads,
                                    optimizer=state.optimizer + more.optimizer)
    layers = cfg.n_layers // su.pp                    # every rank holds L/pp (all its chunks)
    per_layer = activation_bytes_per_layer(cfg, su)
    alive = in_flight(su)
    working = 0
    if su.recompute == "full":
        seq = su.seq or cfg.seq_len
        working = layer_bytes(su.micro_batch, seq // su.cp, cfg.hidden, cfg.n_heads, su.tp,
                              sp=su.sp, regather=su.regather, precision=precision,
                              **shape_kwargs(cfg, su))
    activations = round(per_layer * layers * alive) + working
    return Estimate(state.params, state.grads, state.optimizer, activations, alive, layers,
                    per_layer, working)


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


def table(cfg: ModelConfig, su: Setup) -> str:
    e = estimate(cfg, su)
    lines = [f"{name:<17}{_gib(value)}" for name, value in e.components().items()]
    lines.append(f"{'total':<17}{_gib(e.total)}")
    detail = (f"activations: {e.layers} layers x {e.in_flight:g} micro-batches in flight x "
              f"{e.layer_activation_bytes / 2**20:.2f} MiB per layer")
    if e.recompute_working_set:
        detail += f" + {e.recompute_working_set / 2**20:.2f} MiB recompute working set"
    return "\n".join(lines + [detail])
