"""python -m minitron.estimate plan: which split of a model over a cluster, and how fast.

The planner is minitron/estimate/plan.py (what it enumerates and how it ranks), the step-time
model minitron/estimate/time_model.py (every term), the GPUs minitron/hardware.py;
this is their command line. Examples:

    python -m minitron.estimate plan --model gpt3-175b --gpus 1024 --gpu a100 --global-batch 1536
    python -m minitron.estimate plan --model 1t --gpus 3072 --gpu h100 --global-batch 3072 \\
        --explain tp=8,pp=64,dp=6,mb=1,recompute=full
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..config import ModelConfig
from ..hardware import GIB, GPUS, gpu as named_gpu
from .memory import PRESETS, preset
from . import published
from .plan import RECOMPUTES, best_per_split, evaluate, memory, plan, zero3_units
from .shape import Shape, expert_ffn, shared_experts
from .time_model import SOFTWARE, Cluster, Parallel

EXPLAIN_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "ep": "ep", "v": "virtual",
                "virtual": "virtual", "mb": "micro_batch", "zero": "zero", "recompute": "recompute",
                "sp": "sp", "schedule": "schedule", "trim": "trim"}
DEFAULT_MODEL = "gpt3-175b"
GPU_OVERRIDES = {"peak_tflops": ("peak_flops", 1e12), "memory_gib": ("memory_bytes", GIB),
                 "hbm_tbs": ("hbm_bw", 1e12), "nvlink_gbs": ("nvlink_bw", 1e9), "net_gbs": ("net_bw", 1e9)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.estimate plan", description=__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help=f"preset: {', '.join(PRESETS)} (default {DEFAULT_MODEL}: what no flag gives is its)")
    for opt, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "query heads"),
                      ("kv-heads", "key/value heads (grouped-query attention when fewer)"),
                      ("ffn-hidden", "the MLP's width (default 4 x hidden)"), ("vocab", "vocabulary"),
                      ("experts", "routed experts per MoE layer"), ("topk", "experts per token"),
                      ("moe-ffn-hidden", "each expert's MLP width (default --ffn-hidden)"),
                      ("shared-experts", "experts every token visits (DeepSeekMoE)")):
        m.add_argument(f"--{opt}", type=int, default=None, help=f"{what}; overrides the preset's")
    m.add_argument("--activation", choices=("gelu", "swiglu"), default=None)
    m.add_argument("--norm", choices=("layernorm", "rmsnorm"), default=None)
    m.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                   help="tie the input embedding and the output layer")
    m.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=64)
    c.add_argument("--gpu", default="a100", help=f"one of {', '.join(GPUS)}")
    for opt in GPU_OVERRIDES:
        c.add_argument(f"--{opt.replace('_', '-')}", dest=opt, type=float, default=None,
                       help="override the GPU's " + GPU_OVERRIDES[opt][0])
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: --gpus)")
    c.add_argument("--software", choices=list(SOFTWARE), default="megatron-core",
                   help="the feature set (estimate/software.py): the planner proposes nothing outside it")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="how many of the best to print")
    o.add_argument("--explain", default=None, metavar="CONFIG",
                   help="one configuration's step by term, e.g. tp=8,pp=8,dp=16,mb=1,recompute=full")
    return p


def _model_label(name: str | None, given: list[str]) -> str:
    """The header's name: a preset, a preset with flags overriding it, or a shape given by flags
    (naming the preset its unset fields come from, so a GPT-3 norm or tie is never silent)."""
    if name is None and given:
        return f"model from flags (the rest, e.g. norm and tie, is {DEFAULT_MODEL}'s)"
    name = name or DEFAULT_MODEL
    return name + (" with " + ", ".join(given) + " overridden" if given else "")


def _positive(args, flag: str, works: int) -> None:
    value = getattr(args, flag.replace("-", "_"))
    if value is not None and value < 1:
        raise ValueError(f"--{flag} {value}: must be a positive integer, e.g. --{flag} {works}")


def _model(args) -> ModelConfig:
    base = preset(args.model or DEFAULT_MODEL)
    cfg = base if isinstance(base, Shape) else Shape(**{f.name: getattr(base, f.name)
                                                      for f in dataclasses.fields(base)})
    sizes = {"n_layers": args.layers, "hidden": args.hidden, "n_heads": args.heads,
             "n_kv_heads": args.kv_heads, "ffn_hidden": args.ffn_hidden, "vocab_size": args.vocab,
             "n_experts": args.experts, "topk": args.topk, "moe_ffn_hidden": args.moe_ffn_hidden,
             "shared_experts": args.shared_experts, "activation": args.activation, "norm": args.norm,
             "tie_embeddings": args.tie}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if "n_heads" in sizes and "n_kv_heads" not in sizes and cfg.n_kv_heads and sizes["n_heads"] % cfg.n_kv_heads:
        sizes["n_kv_heads"] = None       # the preset's kv heads do not divide the new head count
    cfg = dataclasses.replace(cfg, **sizes)
    if args.seq and args.seq > cfg.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=args.seq)
    return cfg


def _cluster(args) -> Cluster:
    if args.gpu.lower() not in GPUS:
        raise ValueError(f"--gpu {args.gpu}: choose one of {', '.join(GPUS)}, e.g. --gpu a100 "
                         "(then --peak-tflops, --memory-gib, --hbm-tbs, --nvlink-gbs, --net-gbs "
                         "override its numbers)")
    g = named_gpu(args.gpu)
    for opt, (field, unit) in GPU_OVERRIDES.items():
        value = getattr(args, opt)
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{opt.replace('_', '-')} {value:g}: must be positive, e.g. "
                                 f"--{opt.replace('_', '-')} {getattr(g, field) / unit:g}")
            g = dataclasses.replace(g, **{field: value * unit})
    return Cluster(g, args.gpus_per_node)


def parse_config(text: str, gpus: int, software: str = "megatron-core") -> Parallel:
    """'tp=8,pp=8,mb=1,recompute=full,sp' -> Parallel (dp defaults to what the GPUs leave)."""
    fields = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in EXPLAIN_KEYS:
            raise ValueError(f"--explain: unknown key {key!r}: use {', '.join(sorted(EXPLAIN_KEYS))}, "
                             "e.g. --explain tp=8,pp=8,mb=1,recompute=full")
        field = EXPLAIN_KEYS[key]
        if field == "sp":
            fields[field] = value in ("", "1", "true", "True")
        elif field in ("recompute", "schedule"):
            fields[field] = value
        else:
            try:
                fields[field] = int(value)
            except ValueError:
                raise ValueError(f"--explain: {key}={value!r} is not an integer, e.g. {key}=1") from None
    if fields.get("recompute", "none") not in RECOMPUTES:
        raise ValueError(f"--explain: recompute={fields['recompute']!r}: choose one of {RECOMPUTES}")
    rest = gpus // max(1, fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1) * fields.get("ep", 1))
    fields.setdefault("dp", max(rest, 1))
    if fields.get("virtual", 1) > 1:
        fields.setdefault("schedule", "interleaved")
    fields.setdefault("zero", 1 if 1 in SOFTWARE[software].zeros else 0)   # the software's own
    par = Parallel(**fields)
    if par.gpus != gpus:
        raise ValueError(f"--explain: tp*pp*dp*cp*ep = {par.gpus} but --gpus is {gpus}: "
                         f"leave dp out (it is then --gpus / (tp*pp*cp*ep)) or set --gpus {par.gpus}")
    return par


def describe(name: str, cfg, seq: int) -> str:
    text = (f"{name}: layers={cfg.n_layers} hidden={cfg.hidden} heads={cfg.n_heads} "
            f"kv_heads={cfg.kv_heads} ffn={cfg.ffn} {cfg.activation} {cfg.norm} vocab={cfg.vocab_size} "
            f"seq={seq}{' tied' if cfg.tie_embeddings else ''}")
    if cfg.n_experts:
        text += (f" experts={cfg.n_experts} top-{cfg.topk} expert_ffn={expert_ffn(cfg)}"
                 + (f" shared={shared_experts(cfg)}" if shared_experts(cfg) else ""))
    return text


def _row(o) -> str:
    t = o.time
    return (f"{o.par.label():<52} {o.memory / GIB:7.1f} {t.seconds:9.3f} {t.flops_per_gpu / 1e12:8.1f} "
            f"{100 * t.mfu:5.1f}% {t.tokens_per_s:12,.0f}")


def explain(cfg, par, cluster, batch, seq, software) -> str:
    option = evaluate(cfg, par, cluster, batch, seq, software)
    e = memory(cfg, par, batch, seq, software)
    parts = e.components() | ({"ZeRO-3 gathered units": zero3_units(cfg, par)} if par.zero == 3 else {})
    lines = [f"configuration: {par.label()}",
             "memory (first pipeline rank): " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts.items())
             + f"; total {sum(parts.values()) / GIB:.1f} GiB of {cluster.gpu.memory_bytes / GIB:.0f} GiB"]
    if option.time is None:
        return "\n".join(lines + [option.reason])
    t = option.time
    lines.append(f"step {t.seconds:.3f} s over {t.microbatches} micro-batches, by term:")
    lines += [f"  {k:<18}{v:10.4f} s {100 * v / t.seconds:6.1f}%" for k, v in t.terms.items() if v]
    lines.append(f"{t.flops_per_gpu / 1e12:.1f} TFLOP/s per GPU (recomputation counted), "
                 f"MFU {100 * t.mfu:.1f}%, {t.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for flag, works in (("gpus", 8), ("gpus-per-node", 8), ("global-batch", args.gpus or 8), ("seq", 2048),
                            ("top", 5), ("layers", 24), ("hidden", 1024), ("heads", 16), ("vocab", 51200),
                            ("kv-heads", 8), ("ffn-hidden", 4096), ("experts", 8), ("topk", 2),
                            ("moe-ffn-hidden", 2048)):
            _positive(args, flag, works)
        cfg, cluster = _model(args), _cluster(args)
        batch, seq = args.global_batch or args.gpus, args.seq or cfg.seq_len
        given = [f for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "experts", "topk",
                             "moe_ffn_hidden", "shared_experts", "activation", "norm", "tie") if getattr(args, f) is not None]
        print(describe(_model_label(args.model, given), cfg, seq))
        print(f"{args.gpus} x {cluster.gpu.name}, {cluster.gpus_per_node} per node; global batch {batch}; "
              f"software {args.software}")
        if args.explain:
            par = parse_config(args.explain, args.gpus, args.software)
            try:
                text = explain(cfg, par, cluster, batch, seq, args.software)
            except ValueError as e:
                raise ValueError(f"--explain {args.explain}: {e}") from None
            print(text)
            print(published.accuracy_line())
            return 0
        options = plan(cfg, args.gpus, cluster, batch, seq, args.software)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fits = [o for o in options if o.time]
    print(f"{len(options)} configurations, {len(fits)} fit")
    if not fits:
        smallest = options[0]
        print(f"none fits: the smallest, {smallest.par.label()}, {smallest.reason}; "
              "add GPUs (--gpus) or choose a larger GPU (--gpu h200)")
        return 1
    print(f"{'configuration':<52} {'GiB':>7} {'step s':>9} {'TFLOP/s':>8} {'MFU':>6} {'tokens/s':>12}")
    shown = []                       # equal time and memory (ZeRO-1 vs -2 under accumulation): the lower stage
    for o in fits:
        if len(shown) == args.top:
            break
        if not shown or (o.time.seconds, o.memory) != (shown[-1].time.seconds, shown[-1].memory):
            shown.append(o)
            print(_row(o))
    print("why the others lost (the best of each tp x pp x cp x ep split):")
    splits = best_per_split(options)
    shown = [o for o in splits if o.time][1:args.top * 2] + [o for o in splits if not o.time][:args.top]
    for o in shown:
        print(f"  {o.par.label():<52} {o.reason}")
    counts = {}
    for o in options[1:]:
        kind = "did not fit" if o.time is None else o.reason.split(" (")[0].split(" s ")[-1]
        counts[kind] = counts.get(kind, 0) + 1
    print("all losers by reason: " + "; ".join(f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])))
    print(published.accuracy_line())
    return 0

