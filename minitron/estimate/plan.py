"""The planner: every way to split a model over a cluster, the ones that fit, ranked by step time.

A configuration is (tp, pp, virtual stages, dp, cp, ep, micro-batch, ZeRO stage, recomputation,
schedule). `candidates` enumerates the valid ones (tp divides the heads, pp x virtual the
layers, ep the experts, dp x ep x micro-batch the global batch, interleaving needs m a multiple
of pp); `plan` keeps those whose predicted memory (memory.estimate, the first pipeline rank,
bf16 with fp32 Adam state) fits the GPU with a margin, times each with time_model.step_time and
ranks them. Every loser gets a reason: it did not fit, or the term of its step that grew the
most against the winner's (bubble, TP comm across nodes, recomputation, ...).

The software (software.py) bounds the space: a feature outside its setting is never proposed
(megatron-2021 has no sequence parallelism, selective recomputation, context parallelism or
ZeRO; megatron-2019 no pipeline). Where the software has sequence parallelism it is always on
with tp > 1: it moves the same bytes as TP's all-reduces and divides the norm/dropout
activations and their work by tp, so a configuration without it never wins (MoE with tp > 1
needs it anyway).
"""
from __future__ import annotations

import dataclasses

from .. import refusals
from ..config import ModelConfig, divisors
from .memory import Setup, estimate
from .software import RECOMPUTES, Software, software as named_software
from .time_model import Breakdown, Cluster, Parallel, params_per_rank, step_time

MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL = (1, 2, 3, 4)
MEMORY_MARGIN = 0.9          # the estimate is a floor (no allocator slack, CUDA context, logits)


@dataclasses.dataclass(frozen=True)
class Option:
    par: Parallel
    memory: int                        # bytes on the first pipeline rank
    time: Breakdown | None             # None when it does not fit
    reason: str = ""                   # why it lost (empty for the winner)


def setup(par: Parallel, cfg: ModelConfig, global_batch: int, seq: int,
          software: str = "megatron-core") -> Setup:
    sw = named_software(software)
    m = global_batch // (par.dp * par.ep * par.micro_batch)
    return Setup(tp=par.tp, sp=par.sp, pp=par.pp, virtual=par.virtual, schedule=par.schedule,
                 microbatches=m, dp=par.dp, cp=par.cp, ep=par.ep, micro_batch=par.micro_batch,
                 seq=seq, zero=par.zero, recompute=par.recompute, regather=par.sp,
                 grad_dtype="float32" if sw.fp32_main_grads else None,
                 flash_attention=sw.flash_attention)


def candidates(cfg: ModelConfig, gpus: int, global_batch: int, seq: int, max_tp: int = 16,
               max_cp: int = 8, schedules=("1f1b", "interleaved"), recomputes=RECOMPUTES,
               sequence_parallel: bool = True, zeros=(0, 1, 2, 3), software: str = "megatron-core"):
    """Every valid Parallel for `gpus` GPUs that the software offers (module docstring)."""
    sw = named_software(software)
    schedules = [x for x in schedules if x in sw.schedules and (x != "interleaved" or sw.interleaving)]
    recomputes = [r for r in recomputes if r in sw.recomputes]
    sequence_parallel = sequence_parallel and sw.sequence_parallel
    zeros = [z for z in zeros if z in sw.zeros]
    max_cp = max_cp if sw.context_parallel else 1
    for tp in [t for t in divisors(cfg.n_heads) if t <= max_tp and gpus % t == 0
               and cfg.kv_heads % t == 0]:
        for pp, trim in _splits(cfg.n_layers, sw):
            if gpus % (tp * pp):
                continue
            for cp in [c for c in (1, 2, 4, 8) if c <= max_cp and seq % (2 * c) == 0
                       and gpus % (tp * pp * c) == 0]:
                if sequence_parallel and (seq // cp) % tp:
                    continue                   # sequence parallelism splits each rank's tokens
                for ep in (divisors(cfg.n_experts) if cfg.n_experts else [1]):
                    if gpus % (tp * pp * cp * ep):
                        continue
                    dp = gpus // (tp * pp * cp * ep)
                    yield from _inner(cfg, global_batch, tp, pp, cp, ep, dp, schedules, recomputes,
                                      sequence_parallel and tp > 1, zeros, trim)


def _splits(n_layers: int, sw: Software):
    """(pp, trim): every even cut of the layers, and, where the software has uneven stages, the
    pipelines an even cut cannot make whose first and last stage take one layer fewer."""
    for p in range(1, n_layers + 1):
        if n_layers % p == 0 and (p == 1 or sw.pipeline):
            yield p, 0
        elif sw.uneven_stages and p > 2 and (n_layers + 2) % p == 0 and (n_layers + 2) // p > 1:
            yield p, 1


def _inner(cfg, global_batch, tp, pp, cp, ep, dp, schedules, recomputes, sp, zeros, trim=0):
    for mb in MICRO_BATCHES:
        if global_batch % (dp * ep * mb):
            continue
        m = global_batch // (dp * ep * mb)
        for v in (VIRTUAL if pp > 1 else (1,)):
            schedule = "interleaved" if v > 1 else "1f1b"
            if (cfg.n_layers + 2 * trim) % (pp * v) or schedule not in schedules or (v > 1 and m % pp):
                continue
            for zero in (zeros if dp * cp > 1 else [z for z in zeros if z == 0][:1]):
                if refusals.refusal(refusals.Options(
                        pp=pp, dp=dp, ep=ep, n_experts=cfg.n_experts, zero=zero,
                        tie_embeddings=cfg.tie_embeddings), "engine"):
                    continue                   # the engine refuses these (minitron/refusals/)
                for recompute in recomputes:
                    yield Parallel(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, virtual=v, micro_batch=mb,
                                   zero=zero, recompute=recompute, sp=sp, schedule=schedule, trim=trim)


def zero3_units(cfg: ModelConfig, par: Parallel) -> int:
    """ZeRO-3 (FSDP) holds one layer's parameters gathered whole while it runs and prefetches the
    next: two units of 16-bit weights and their 16-bit gradients before the reduce-scatter
    (memory.estimate counts only the shards)."""
    if par.zero != 3:
        return 0
    dense, expert = params_per_rank(cfg, par)
    layers = max(1, par.stage_layers(cfg.n_layers))
    per_layer = (dense - cfg.vocab_size * cfg.hidden / par.tp) / layers + expert / layers
    return round(2 * (2 + 2) * per_layer)


def memory(cfg: ModelConfig, par: Parallel, global_batch: int, seq: int, software: str = "megatron-core"):
    """memory.estimate of the first pipeline rank. Uneven stages: as if every stage held a middle
    stage's layers (an upper bound on the first, which holds `trim` fewer; about right for the
    second, which keeps one micro-batch fewer in flight)."""
    mem_cfg = dataclasses.replace(cfg, n_layers=cfg.n_layers + 2 * par.trim) if par.trim else cfg
    return estimate(mem_cfg, setup(par, cfg, global_batch, seq, software))


def evaluate(cfg: ModelConfig, par: Parallel, cluster: Cluster, global_batch: int, seq: int,
             software: str = "megatron-core") -> Option:
    refused = named_software(software).refusal(par)
    if refused:
        raise ValueError(f"{par.label()}: {refused}; choose another --software or configuration")
    mem = memory(cfg, par, global_batch, seq, software).total + zero3_units(cfg, par)
    if mem > MEMORY_MARGIN * cluster.gpu.memory_bytes:
        gib = 2**30
        return Option(par, mem, None, f"does not fit: {mem / gib:.1f} GiB > "
                                      f"{MEMORY_MARGIN:.0%} of {cluster.gpu.memory_bytes / gib:.0f} GiB")
    return Option(par, mem, step_time(cfg, par, cluster, global_batch, seq, software))


def why_slower(option: Option, best: Option, gpus_per_node: int) -> str:
    """The term of option's step that grew most against best's, in words."""
    diff = {k: v - best.time.terms.get(k, 0.0) for k, v in option.time.terms.items()}
    term = max(diff, key=diff.get)
    extra = f"+{diff[term]:.3g} s {term}"
    if term == "TP comm" and option.par.tp > gpus_per_node:
        return f"TP across nodes ({extra})"
    if term == "compute":
        a, b = option.par, best.par
        more_recompute = RECOMPUTES.index(a.recompute) > RECOMPUTES.index(b.recompute)
        for differs, why in ((more_recompute, f"recomputation {a.recompute}"),
                             (a.cp != b.cp, f"cp{a.cp}: shorter sequences, smaller GEMMs"),
                             (a.tp != b.tp, f"tp{a.tp}: narrower GEMMs"),
                             (a.micro_batch != b.micro_batch, f"micro-batch {a.micro_batch}: smaller GEMMs"),
                             (a.pp > b.pp, f"pp{a.pp}: the output layer weighs more on the last stage")):
            if differs:
                return f"{why} ({extra})"
    return extra


def plan(cfg: ModelConfig, gpus: int, cluster: Cluster, global_batch: int, seq: int | None = None,
         software: str = "megatron-core", **kw) -> list[Option]:
    """Every candidate, the fastest first; losers carry their reason."""
    seq = seq or cfg.seq_len
    options = [evaluate(cfg, par, cluster, global_batch, seq, software)
               for par in candidates(cfg, gpus, global_batch, seq, software=software, **kw)]
    if not options:
        raise ValueError(f"no configuration splits {gpus} GPUs with global batch {global_batch}: "
                         f"choose a batch that is a multiple of the data-parallel size, e.g. "
                         f"--global-batch {gpus}")
    fits = sorted((o for o in options if o.time), key=lambda o: (o.time.seconds, o.memory, o.par.zero))
    if not fits:
        return sorted(options, key=lambda o: o.memory)
    best = fits[0]
    ranked = [best] + [dataclasses.replace(o, reason=why_slower(o, best, cluster.gpus_per_node))
                       for o in fits[1:]]
    return ranked + sorted((o for o in options if not o.time), key=lambda o: o.memory)


def best_per_split(options: list[Option]) -> list[Option]:
    """The best option of every (tp, pp, cp, ep) split, in ranked order: who lost, and why."""
    seen, out = set(), []
    for o in options:
        key = (o.par.tp, o.par.pp, o.par.cp, o.par.ep)
        if key not in seen:
            seen.add(key)
            out.append(o)
    return out
