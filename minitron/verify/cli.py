"""python -m minitron.verify: the command line (what it compares: the package's docstring)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from ..grid import CP_VARIANTS, ParallelConfig
from ..refusals import Refused
from ..model.splits import validate_model
from ..config import CHOICES, ConfigError, ModelConfig, check_adamw
from ..model.fused import enable_kernels
from ..moe import expert_layout
from ..moe.expert_layout import EXPERT_LAYOUTS
from ..runtime import placement
from ..pipeline.schedules import SCHEDULES
from . import __doc__ as VERIFY_DOC
from .plants import Plant
from ..train.flags import BALANCE, UsageError, _Parser, balance_fields, group_fields
from ..tensor_parallel.fp8 import RECIPES
from ..train.engine import check_supported, resolve_schedule, uses_engine
from ..train.precision import PRECISIONS, resolve_precision
from .run import check_comparable, split_batch, verify, verify_recipe
from .steps import BUCKET_NUMEL, FP16_LOSS_SCALE


EXAMPLES = """examples:
  python -m minitron.verify --tp 2 --sp
  python -m minitron.verify --tp 2 --sp --norm rmsnorm --activation swiglu --position rope --kv-heads 2
  python -m minitron.verify --tp 2 --sp --tp-comm-overlap   SP's comm behind the GEMMs
  python -m minitron.verify --tp 2 --sp --kernels      fused Triton kernels and FusedAdamW
  python -m minitron.verify --tp 1 --cp 2              ring attention over 2 ranks (zigzag chunks)
  python -m minitron.verify --tp 2 --sp --cp 2 --cp-variant ulysses
  python -m minitron.verify --tp 1 --cp 2 --dp 2 --zero 1   context and data parallelism with ZeRO-1
  python -m minitron.verify --tp 1 --cp 2 --pp 2 --schedule zb-h1 --microbatches 4   cp inside stages
  python -m minitron.verify --tp 1 --pp 2 --schedule zb-h1 --microbatches 4
  python -m minitron.verify --tp 2 --sp --pp 2 --schedule 1f1b --microbatches 4
  python -m minitron.verify --tp 1 --pp 4 --virtual 2 --schedule interleaved --microbatches 8 --layers 8
  python -m minitron.verify --tp 1 --dp 2               data parallel: each replica its rows
  python -m minitron.verify --tp 1 --ep 2 --experts 4 --balance aux-free   expert biases, bitwise
  python -m minitron.verify --tp 2 --sp --dp 2 --zero 1 Megatron's distributed optimizer
  python -m minitron.verify --tp 1 --dp 4 --zero 3      parameters sharded too
  python -m minitron.verify --tp 1 --dp 4 --dp-shard 2 --zero 3   HSDP: sharded in pairs, 2 replicas
  python -m minitron.verify --tp 1 --cp 4 --cp-variant hierarchical --cp-a2a 2   Ulysses in pairs, ring across
  python -m minitron.verify --tp 1 --dp 2 --pp 2 --zero 3 --schedule zb-h1 --microbatches 4   ZeRO-3 in stages
  python -m minitron.verify --tp 2 --dtype bfloat16     16-bit, fp32 master weights
  python -m minitron.verify --tp 2 --sp --dtype fp8 --fp8-recipe current   FP8 GEMMs vs one device's
  python -m minitron.verify --tp 2 --sp --dtype fp8 --fp8-recipe blockwise   a scale per block (mxfp8 too)
  python -m minitron.verify --ep 2 --experts 4 --topk 2  experts on 2 ranks (tp defaults to 1)
  python -m minitron.verify --ep 2 --tp 2 --sp --experts 4
  python -m minitron.verify --ep 4 --experts 8 --capacity-factor 1.0
  python -m minitron.verify --ep 2 --dp 2 --experts 4
  python -m minitron.verify --ep 2 --experts 8 --max-nodes 1   each token's experts on one ep rank
  python -m minitron.verify --ep 2 --experts 4 --dtype bfloat16 (the reference's routing, by default in 16 bits)
  python -m minitron.verify --tp 8 --dp 2 --gpus-per-node 4 --explain   which groups leave a node
  python -m minitron.verify --tp 2 --cp 2 --ep 2 --explain --expert-layout megatron-core --expert-tp 1

exit status: 0 PASS, 1 FAIL, 2 bad options"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the examples kept line by line."""


# ConfigError's fields -> this command's flags, so a refusal names what to type
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "ep": "--ep", "virtual_pp": "--virtual",
         "sequence_parallel": "--sp", "tp_comm_overlap": "--tp-comm-overlap", "cp_variant": "--cp-variant", "vocab_size": "--vocab",
         "dp_shard": "--dp-shard", "cp_a2a": "--cp-a2a", "zero": "--zero",
         "seq_len": "--seq", "hidden": "--hidden", "n_layers": "--layers", "n_heads": "--heads",
         "n_kv_heads": "--kv-heads", "norm": "--norm", "activation": "--activation",
         "position": "--position", "dropout": "--dropout", "recompute": "--recompute",
         "n_experts": "--experts", "topk": "--topk", "moe_every": "--moe-every",
         "capacity_factor": "--capacity-factor", "router_pre_softmax": "--pre-softmax",
         "aux_loss_coeff": "--aux-loss", "aux_loss_scope": "--aux-loss-scope", "z_loss_coeff": "--z-loss",
         "expert_bias": "--balance aux-free", "bias_update_rate": "--bias-update-rate",
         "max_groups": "--max-nodes", "expert_groups": "--expert-groups", "lr": "--lr", "eps": "--eps", "dtype": "--dtype", "expert_tp": "--expert-tp", "expert_layout": "--expert-layout"}


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m minitron.verify", description=VERIFY_DOC.split("\n")[0],
                epilog=EXAMPLES, formatter_class=_HelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default 2; 1 with --ep > 1)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="SP's all-gather / reduce-scatter chunk by chunk behind the GEMMs (needs --sp)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages' ranks)")
    g.add_argument("--virtual", type=int, default=1, dest="virtual_pp",
                   help="model chunks (stages) per pipeline rank: interleaved schedules")
    g.add_argument("--schedule", choices=sorted(SCHEDULES), default=None,
                   help="pipeline schedule (default with --pp > 1: 1f1b, interleaved with --virtual > 1; "
                        "zb-v and dualpipev always have 2 chunks per rank)")
    g.add_argument("--microbatches", type=_positive, default=None,
                   help="micro-batches per step of a pipeline schedule (default 2 * pp)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size: every sequence split "
                   "over cp ranks (2*cp zigzag chunks)")
    g.add_argument("--cp-variant", choices=CP_VARIANTS, default="ring",
                   help="how attention reaches the other cp ranks' keys and values")
    g.add_argument("--cp-a2a", type=int, default=None, help="--cp-variant hierarchical: Ulysses "
                   "inside groups of this many cp ranks, a ring across the groups")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size: replicas, each on its "
                   "own rows of the batch")
    g.add_argument("--dp-shard", type=int, default=None, help="HSDP: ZeRO shards over this many dp "
                   "ranks, dp/this replicas of each shard (default dp; needs --zero 1-3)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of the data-parallel engine (default: 0 where one runs)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size: the experts of each "
                   "MoE layer spread over ep ranks (needs --experts; a replica of the dense layers)")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=_positive, default=3)
    r.add_argument("--dtype", choices=PRECISIONS, default="float32",
                   help="16-bit: fp32 master weights; fp8: bf16 training with FP8 GEMMs in the "
                        "blocks; compared with one device in the same precision, against that "
                        "precision's measured noise (see the module docstring)")
    r.add_argument("--fp8-recipe", choices=RECIPES, default=None,
                   help="with --dtype fp8: each tensor's scale from an amax history (delayed, the "
                        "default) or from its own amax (current); or a scale per block: 1x128 "
                        "tiles and 128x128 weight blocks (blockwise, DeepSeek-V3's), 32-element "
                        "power-of-two-scaled blocks (mxfp8); blocks shrink to divide every "
                        "rank's piece (tensor_parallel/fp8_blocks.py)")
    r.add_argument("--no-fp8-amax-reduce", dest="fp8_amax_reduce", action="store_false",
                   help="with --dtype fp8: each rank's own amaxes (default: all-reduced over tp x cp x "
                        "dp); verify refuses it where a tensor is split (no one device casts so)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    r.add_argument("--eps", type=float, default=1e-6, help="AdamW eps (see the module docstring)")
    r.add_argument("--batch", type=_positive, default=None,
                   help="sequences per step (default per dp replica: one per micro-batch with a "
                        "pipeline, else 2)")
    r.add_argument("--kernels", action="store_true",
                   help="the split model uses minitron.kernels (fused Triton norms, attention, MLP "
                        "activations, loss) and FusedAdamW; on CPU ranks through the Triton "
                        "interpreter (TRITON_INTERPRET=1, set here; a few seconds at the default shape)")
    r.add_argument("--recompute", choices=CHOICES["recompute"], default="none",
                   help="activation recomputation in the split model (minitron/model/recompute.py): "
                        "every layer (full) or the attention core (selective)")
    r.add_argument("--plant", default=None, help=argparse.SUPPRESS)   # tests: plants.PLANTS
    r.add_argument("--matrix", action="store_true",
                   help="every combination of tp, pp, dp, cp, ep in {1, 2} on at most 8 ranks, then "
                        "every feature composed with others, one row each (minitron/verify/"
                        "matrix.py), at the model options' shape; the parallel options are ignored")
    r.add_argument("--quick", action="store_true", help="with --matrix: a representative subset")
    r.add_argument("--explain", action="store_true",
                   help="print each group kind's ranks and whether it stays inside a node "
                        "(minitron/runtime/placement.py), then exit without starting ranks")
    r.add_argument("--expert-layout", choices=EXPERT_LAYOUTS, default="minitron",
                   help="with --explain: also the expert groups of this layout (megatron-core: "
                        "minitron/moe/expert_layout.py); the runs use minitron's")
    r.add_argument("--expert-tp", type=_positive, default=None,
                   help="with --explain --expert-layout megatron-core: the experts' own tp size "
                        "(default --tp)")
    r.add_argument("--gpus-per-node", type=_positive, default=8,
                   help="devices per node, for --explain and the warning when a tp group spans nodes")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=None, help="(default 2; 4 with --matrix)")
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: heads)")
    m.add_argument("--seq", type=int, default=16)
    m.add_argument("--vocab", type=int, default=128)
    m.add_argument("--norm", choices=CHOICES["norm"], default="layernorm")
    m.add_argument("--activation", choices=CHOICES["activation"], default="gelu")
    m.add_argument("--position", choices=CHOICES["position"], default="learned")
    m.add_argument("--dropout", type=float, default=0.1)
    m.add_argument("--tie", action="store_true", help="tie the output layer to the embedding")
    m.add_argument("--no-bias", action="store_true", help="no biases on the linear layers")
    e = p.add_argument_group("experts")
    e.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)")
    e.add_argument("--topk", type=_positive, default=2, help="experts per token")
    e.add_argument("--moe-every", type=_positive, default=1, help="layers 0, k, 2k, ... are MoE")
    e.add_argument("--capacity-factor", type=float, default=None,
                   help="tokens per expert and sequence = ceil(factor * seq * topk / experts); "
                        "default dropless")
    e.add_argument("--pre-softmax", action="store_true", help="softmax over all experts, then top-k")
    e.add_argument("--aux-loss", type=float, default=None,
                   help="Switch load-balancing coefficient (default 0.01; 0 with --balance aux-free)")
    e.add_argument("--balance", choices=BALANCE, default="aux-loss",
                   help="aux-free: DeepSeek-V3's per-expert router bias, moved by +-rate after every "
                        "step by the step's load summed over the ranks (minitron/moe/balance.py); "
                        "compared with one device's bitwise")
    e.add_argument("--bias-update-rate", type=float, default=None,
                   help="with --balance aux-free: the bias step per optimizer step (default 1e-3)")
    e.add_argument("--max-nodes", type=_positive, help="node-limited routing: each token's experts in at most "
                   "this many expert groups (minitron/moe/router.py)")
    e.add_argument("--expert-groups", type=_positive, help="with --max-nodes: groups (default --ep)")
    e.add_argument("--aux-loss-scope", choices=CHOICES["aux_loss_scope"], default="global",
                   help="whose tokens the balance loss counts: every replica's (global) or each "
                        "dp x ep replica's own (replica: not comparable beyond one replica)")
    e.add_argument("--reference-routing", action=argparse.BooleanOptionalAction, default=None,
                   help="the split model's routers take the reference's (token, expert) choices, "
                        "so a rounding flip of a top-k does not end the comparison, and their own "
                        "flips are judged by the reference's scores (default: on in 16 bits and "
                        "fp8, off in float32; minitron/verify/routing.py)")
    e.add_argument("--z-loss", type=float, default=1e-3, help="router z-loss coefficient")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:              # argparse's one line, without its usage block
        print(f"error: {e}; see python -m minitron.verify --help", file=sys.stderr)
        return 2
    if args.matrix:
        return _matrix(args)
    try:
        check_adamw(args.lr, args.eps)
        tp = args.tp if args.tp is not None else (1 if args.ep > 1 else 2)
        pcfg = ParallelConfig(tp=tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                              virtual_pp=args.virtual_pp, sequence_parallel=args.sp,
                              cp_variant=args.cp_variant, gpus_per_node=args.gpus_per_node,
                              tp_comm_overlap=args.tp_comm_overlap,
                              dp_shard=args.dp_shard, cp_a2a=args.cp_a2a)
        sched = resolve_schedule(pcfg, args.schedule, args.microbatches)
        if sched is not None:
            pcfg = dataclasses.replace(pcfg, virtual_pp=sched.virtual)
        if placement.tp_warning(pcfg):
            print(f"warning: {placement.tp_warning(pcfg)}", file=sys.stderr)
        if not args.explain and (args.expert_layout != "minitron" or args.expert_tp is not None):
            raise ValueError("--expert-layout and --expert-tp are shown by --explain; the runs "
                             "use minitron's layout: add --explain or drop them")
        if args.explain:
            experts = args.expert_layout != "minitron" or args.expert_tp is not None
            print(expert_layout.explain(pcfg, args.expert_layout, args.expert_tp) if experts
                  else placement.explain(pcfg))
            return 0
        batch = split_batch(args.batch, pcfg, sched, "--batch")
        mcfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                           n_layers=args.layers or 2, n_heads=args.heads, n_kv_heads=args.kv_heads,
                           norm=args.norm, activation=args.activation, position=args.position,
                           dropout=args.dropout, tie_embeddings=args.tie, bias=not args.no_bias,
                           use_kernels=args.kernels, recompute=args.recompute,
                           n_experts=args.experts, topk=args.topk, moe_every=args.moe_every,
                           capacity_factor=args.capacity_factor, router_pre_softmax=args.pre_softmax,
                           aux_loss_scope=args.aux_loss_scope, z_loss_coeff=args.z_loss,
                           **balance_fields(args), **group_fields(args))
        validate_model(pcfg, mcfg)
        dtype, fp8 = resolve_precision(args.dtype, args.fp8_recipe, args.fp8_amax_reduce)
        fp8 = verify_recipe(fp8, pcfg, mcfg, batch, sched)
        Plant(args.plant).check_fp8(fp8).check_model(mcfg)
        check_supported(pcfg, mcfg, dtype, args.zero, sched, fp8)   # a bad ZeRO stage
        check_comparable(pcfg, mcfg, dtype, args.zero, sched, fp8, bool(args.reference_routing))
        kernels = "kernels=off (plain torch ops)"
        if args.kernels:
            kernels = enable_kernels(mcfg, pcfg.world_size)   # before anything imports triton
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e.as_flags(FLAGS) if isinstance(e, (ConfigError, Refused)) else e}",
              file=sys.stderr)
        return 2
    pipeline = "" if sched is None else (f"\nschedule={sched.name} microbatches={sched.microbatches} "
                                         f"virtual={sched.virtual} stage_rank={sched.stage_rank}")
    if uses_engine(pcfg, args.zero, dtype):
        scale = f" loss_scale={FP16_LOSS_SCALE:g}" if dtype == torch.float16 else ""
        pipeline += f"\ndata parallel: zero={args.zero or 0} bucket_numel={BUCKET_NUMEL}{scale}"
    if fp8 is not None:
        formats = f"E4M3 throughout, blocks of {fp8.block}" if fp8.fine_grained else \
            "E4M3 forward, E5M2 gradients"
        pipeline += (f"\nfp8: {fp8} in the blocks' GEMMs ({formats}), bf16 "
                     f"elsewhere; against one device's same FP8 GEMMs")
    if os.environ.get("RANK", "0") == "0":       # under torchrun: once, as the report is
        print(f"{pcfg}\n{mcfg}\nbatch={batch} steps={args.steps} dtype={args.dtype} seed={args.seed} "
              f"lr={args.lr} eps={args.eps}\n{kernels}{pipeline}")
    report = verify(pcfg, mcfg, args.steps, dtype=dtype, seed=args.seed, lr=args.lr, eps=args.eps,
                    batch=batch, plant=args.plant, schedule=args.schedule,
                    microbatches=args.microbatches, zero=args.zero,
                    reference_routing=args.reference_routing, fp8=fp8)
    print(report.table())
    print(report.verdict())
    return 0 if report.passed else 1


def _matrix(args) -> int:
    from . import matrix
    if args.plant is not None and args.plant.split(":")[0] not in matrix.PLANT_DIMENSION:
        print(f"error: --plant {args.plant} with --matrix: choose one of "
              f"{', '.join(matrix.PLANT_DIMENSION)}", file=sys.stderr)
        return 2
    try:
        base = dataclasses.replace(
            matrix.DEFAULT_MODEL, vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
            n_layers=args.layers or matrix.DEFAULT_MODEL.n_layers, n_heads=args.heads,
            n_kv_heads=args.kv_heads, norm=args.norm, activation=args.activation,
            position=args.position, dropout=args.dropout, tie_embeddings=args.tie, bias=not args.no_bias)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model: vocab {base.vocab_size}, seq {base.seq_len}, hidden {base.hidden}, "
          f"{base.n_layers} layers, {base.n_heads} heads, {base.n_kv_heads or base.n_heads} kv heads, "
          f"{base.norm}, {base.activation}, {base.position} positions, dropout {base.dropout}", flush=True)
    results = matrix.run(args.quick, steps=args.steps if args.steps != 3 else 2, plant=args.plant,
                         base=base)
    print(matrix.table(results))
    ok = matrix.as_expected(results, args.plant)
    if args.plant:
        print(f"plant {args.plant}: the rows with {matrix.PLANT_DIMENSION[args.plant.split(':')[0]]} "
              f"{'FAIL and the others PASS' if ok else 'do not all FAIL (or others fail too)'}")
    return 0 if ok else 1
