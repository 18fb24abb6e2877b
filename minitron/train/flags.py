"""python -m minitron.train's flags: the parser, and every value checked before any rank starts.

A bad value ends here, as one line naming the flag and a value that works (UsageError, exit 2):
the ranges of the numbers (NaN and infinities too), and through ModelConfig, ParallelConfig and
the engine's own refusals, a model or grid that cannot run (FLAGS maps their fields to flags).
"""
from __future__ import annotations

import argparse
import os

from . import checkpoint_manifest, data    # not checkpoint: it imports torch.distributed.checkpoint
from ..grid import CP_VARIANTS, ParallelConfig
from ..config import CHOICES, ModelConfig, check_number
from ..model.fused import enable_kernels
from ..model.splits import validate_model
from ..model.stages import check_placement
from ..tensor_parallel.fp8 import RECIPES
from .engine import check_supported, resolve_schedule
from .lr import LR_SCHEDULES
from .out_dir import UsageError, check_replacing, check_writable
from .precision import PRECISIONS, resolve_precision

DESCRIPTION = "python -m minitron.train: train the GPT on a text, on any grid, with checkpoints and plots."


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # one line, not argparse's usage block
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m minitron.train", description=DESCRIPTION)
    g = p.add_argument_group("parallelism").add_argument
    for dim in ("tp", "pp", "dp", "cp", "ep", "virtual"):
        g(f"--{dim}", type=int, default=1)
    g("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    g("--tp-comm-overlap", action="store_true", dest="tp_comm_overlap",
      help="SP's all-gather / reduce-scatter chunk by chunk behind the GEMMs (needs --sp)")
    g("--cp-variant", choices=CP_VARIANTS, default="ring", help="how attention crosses cp ranks")
    g("--cp-a2a", type=int, default=None, help="hierarchical cp: Ulysses inside groups of this "
      "many cp ranks, a ring across the groups")
    g("--dp-shard", type=int, default=None, help="HSDP: ZeRO shards over this many dp ranks, "
      "dp/this replicas of each shard (default dp)")
    g("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    g("--schedule", default=None, help="pipeline schedule (1f1b, gpipe, interleaved, zb-h1, ...)")
    g("--microbatches", type=int, default=None, help="default: 2*pp with a pipeline, else 1")
    g("--micro-batch", type=int, default=None, dest="micro_batch",
      help="sequences per micro-batch and replica: --batch / (dp*ep * this) micro-batches per "
           "step, their gradients accumulated (instead of --microbatches)")
    m = p.add_argument_group("model").add_argument
    m("--seq", type=int, default=64)
    m("--hidden", type=int, default=64)
    m("--layers", type=int, default=2)
    m("--heads", type=int, default=4)
    m("--kv-heads", type=int, default=None, help="grouped-query attention (default: heads)")
    m("--norm", choices=CHOICES["norm"], default=None)
    m("--activation", choices=CHOICES["activation"], default=None)
    m("--position", choices=CHOICES["position"], default=None)
    m("--dropout", type=float, default=None)
    m("--tie", action="store_true", help="tie the output layer to the embedding")
    m("--recompute", choices=CHOICES["recompute"], default=None)
    m("--kernels", action="store_true", help="the fused Triton kernels (CPU: their interpreter, slow)")
    m("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLPs)")
    m("--topk", type=int, default=2, help="experts per token")
    m("--capacity-factor", type=float, default=None, help="default dropless")
    m("--balance", choices=BALANCE, default="aux-loss",
      help="how the experts' load is balanced: the Switch auxiliary loss (coefficient 0.01), or "
           "DeepSeek-V3's aux-loss-free per-expert router bias (no auxiliary loss)")
    m("--bias-update-rate", type=float, default=None,
      help="with --balance aux-free: how far each expert's bias moves per step (default 1e-3)")
    m("--max-nodes", type=int, default=None, dest="max_nodes",
      help="node-limited routing (DeepSeek-V3): each token's experts lie in at most this many "
           "expert groups, chosen by the sum of their top-(topk/this) scores")
    m("--expert-groups", type=int, default=None, dest="expert_groups",
      help="with --max-nodes: equal groups of consecutive experts (default --ep: one group per "
           "ep rank, each standing for a node)")
    m("--aux-loss-scope", choices=CHOICES["aux_loss_scope"], default=None,
      help="whose tokens the balance loss counts in each micro-batch: every replica's (global, "
           "the default: the curve does not depend on dp x ep) or each dp x ep replica's own")
    o = p.add_argument_group("optimisation").add_argument
    o("--steps", type=int, default=300)
    o("--batch", type=int, default=16, help="sequences per step (global)")
    o("--lr", type=float, default=3e-3, help="peak learning rate")
    o("--lr-schedule", choices=LR_SCHEDULES, default="cosine")
    o("--warmup", type=int, default=None, help="linear warm-up steps (default: a tenth of --steps)")
    o("--min-lr", type=float, default=None, help="where the cosine ends (default lr/10)")
    o("--weight-decay", type=float, default=0.0)
    o("--clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    o("--dtype", choices=tuple(p for p in PRECISIONS if p != "float64"), default="float32",
      help="16-bit: fp32 master weights; float16 with dynamic loss scaling; fp8: bf16 training "
           "with the blocks' GEMMs in FP8 (E4M3 forward, E5M2 gradients)")
    o("--fp8-recipe", choices=RECIPES, default=None,
      help="with --dtype fp8: scales from an amax history (delayed, the default) or from each "
           "tensor's own amax (current); or a scale per block, E4M3 throughout: 1x128 tiles and "
           "128x128 weight blocks (blockwise, DeepSeek-V3's) or 32-element blocks with power-of-"
           "two scales (mxfp8), each rank's blocks its own (tensor_parallel/fp8_blocks.py)")
    o("--no-fp8-amax-reduce", dest="fp8_amax_reduce", action="store_false",
      help="with --dtype fp8: each rank scales its own pieces by their own amax (default: amaxes "
           "all-reduced over tp x cp x ep x dp, one scale per logical tensor, as Megatron-Core)")
    r = p.add_argument_group("run").add_argument
    r("--seed", type=int, default=0)
    r("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus.txt"))
    r("--out", default="runs/train")
    r("--eval-every", type=int, default=50)
    r("--save-every", type=int, default=100, help="0: no checkpoints")
    r("--resume", default=None, help="a checkpoint directory (any grid may have saved it)")
    r("--overwrite", action="store_true", help="replace the run already in --out (its metrics, "
      "plot and checkpoints)")
    r("--max-restarts", type=int, default=0, dest="max_restarts",
      help="restart every rank from the last checkpoint when one fails, up to N times "
           "(under torchrun: torchrun's own --max-restarts)")
    r("--sample", type=int, default=200, help="characters of generated text at the end; 0: none")
    r("--peak-tflops", type=float, default=None, help="per-device peak for MFU (GPUs: detected)")
    return p


# ConfigError's fields -> this command's flags, so a refusal names what to type
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "ep": "--ep", "virtual_pp": "--virtual",
         "sequence_parallel": "--sp", "tp_comm_overlap": "--tp-comm-overlap", "cp_variant": "--cp-variant", "seq_len": "--seq",
         "dp_shard": "--dp-shard", "cp_a2a": "--cp-a2a", "zero": "--zero",
         "hidden": "--hidden", "n_layers": "--layers", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
         "norm": "--norm", "activation": "--activation", "position": "--position",
         "dropout": "--dropout", "recompute": "--recompute", "n_experts": "--experts", "topk": "--topk",
         "capacity_factor": "--capacity-factor", "aux_loss_scope": "--aux-loss-scope",
         "expert_bias": "--balance aux-free", "bias_update_rate": "--bias-update-rate",
         "max_groups": "--max-nodes", "expert_groups": "--expert-groups", "lr": "--lr", "eps": "--eps", "dtype": "--dtype"}

_MODEL_FLAGS = {"kv_heads": "n_kv_heads", "norm": "norm", "activation": "activation",
                "position": "position", "dropout": "dropout", "recompute": "recompute",
                "aux_loss_scope": "aux_loss_scope"}


BALANCE = ("aux-loss", "aux-free")


def balance_fields(args) -> dict:
    """ModelConfig's balancing fields from --balance, --bias-update-rate and (verify) --aux-loss.
    aux-free: the expert bias, and no Switch loss unless --aux-loss asks for one (DeepSeek-V3
    keeps only a tiny sequence-wise loss, which minitron does not have)."""
    free = args.balance == "aux-free"
    if args.bias_update_rate is not None and not free:
        raise UsageError(f"--bias-update-rate {args.bias_update_rate:g} moves the experts' biases "
                         "of --balance aux-free: add --balance aux-free or drop --bias-update-rate")
    out = {"expert_bias": free}
    aux = getattr(args, "aux_loss", None)
    if aux is not None or free:
        out["aux_loss_coeff"] = aux if aux is not None else 0.0
    if args.bias_update_rate is not None:
        out["bias_update_rate"] = args.bias_update_rate
    return out


def group_fields(args) -> dict:
    """ModelConfig's node-limited routing fields from --max-nodes and --expert-groups (default
    --ep when --max-nodes is given: group g is ep rank g's experts)."""
    groups = args.expert_groups
    if groups is None and args.max_nodes is not None:
        groups = args.ep
    return {"max_groups": args.max_nodes, "expert_groups": groups}


def model_config(args) -> ModelConfig:
    """The ModelConfig the flags ask for; a flag left out keeps ModelConfig's default."""
    given = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items()
             if getattr(args, flag) is not None}
    return ModelConfig(vocab_size=data.VOCAB_SIZE, seq_len=args.seq, hidden=args.hidden,
                       n_layers=args.layers, n_heads=args.heads, tie_embeddings=args.tie,
                       use_kernels=args.kernels, n_experts=args.experts, topk=args.topk,
                       capacity_factor=args.capacity_factor, **given, **balance_fields(args),
                       **group_fields(args))


def configure(args) -> tuple[ModelConfig, ParallelConfig]:
    """Every check that can run before a rank starts; ValueError with the fix."""
    check_flags(args)
    args.warmup = args.steps // 10 if args.warmup is None else args.warmup
    if args.warmup < 0 or args.clip < 0:
        raise UsageError("--warmup and --clip must be >= 0 (0: no warm-up, no clipping)")
    mcfg = model_config(args)
    pcfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                          virtual_pp=args.virtual, sequence_parallel=args.sp,
                          cp_variant=args.cp_variant, tp_comm_overlap=args.tp_comm_overlap,
                          dp_shard=args.dp_shard, cp_a2a=args.cp_a2a)
    validate_model(pcfg, mcfg, args.seq)
    if args.schedule and args.pp == 1 and args.virtual == 1:
        raise UsageError(f"--schedule {args.schedule} needs a pipeline: add --pp 2 (or more)")
    if args.pp > 1 or args.virtual > 1:
        check_placement(mcfg, args.pp, tuple(s % args.pp for s in range(args.pp * args.virtual)))
    replicas = args.dp * args.ep
    if args.micro_batch is not None:
        if args.micro_batch < 1 or args.batch % (replicas * args.micro_batch):
            raise UsageError(f"--micro-batch {args.micro_batch} must divide the {args.batch} "
                             f"sequences of --batch over dp*ep={replicas} replicas: use a divisor "
                             f"of {args.batch // replicas}")
        args.microbatches = args.batch // (replicas * args.micro_batch)
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    if args.batch % (replicas * args.microbatches):
        raise UsageError(f"--batch {args.batch} must split into dp*ep={replicas} replicas of "
                         f"{args.microbatches} micro-batches: use a multiple of "
                         f"{replicas * args.microbatches}")
    try:
        args.dtype_, args.fp8 = resolve_precision(args.dtype, args.fp8_recipe, args.fp8_amax_reduce)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.kernels:
        enable_kernels(mcfg, pcfg.world_size)        # before anything imports triton
    # an unknown or impossible schedule fails here, and what the engine does not run
    check_supported(pcfg, mcfg, args.dtype_, args.zero,
                    resolve_schedule(pcfg, args.schedule, args.microbatches), args.fp8)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    check_writable(args.out)
    args.resume_step = None
    if args.resume:
        manifest = checkpoint_manifest.read_manifest(args.resume)
        checkpoint_manifest.check_compatible(manifest, mcfg, args.resume)
        args.resume_step = manifest["step"]
    check_replacing(args)
    return mcfg, pcfg


def check_flags(args) -> None:
    """Each number flag in its range, NaN and infinities refused: --lr nan trains NaN."""
    for name, what, example in (("steps", "the number of steps", 300), ("batch", "the batch", 16),
                                ("seq", "the sequence length", 64),
                                ("eval_every", "the evaluation interval", 50)):
        check_number(f"--{name.replace('_', '-')}", getattr(args, name), what, example,
                     minimum=1, allow_minimum=True, integer=True)
    check_number("--lr", args.lr, "the learning rate", "3e-4")
    check_number("--weight-decay", args.weight_decay, "the weight decay", 0.1, allow_minimum=True)
    check_number("--clip", args.clip, "the clipping norm (0: off)", 1.0, allow_minimum=True)
    if args.min_lr is not None:
        check_number("--min-lr", args.min_lr, "the final learning rate", "3e-5", allow_minimum=True)
    if args.overwrite and args.resume:
        raise UsageError("--overwrite with --resume: --resume continues the run in --out, "
                         "--overwrite starts a new one there; pass one of them")
    check_number("--save-every", args.save_every, "the checkpoint interval (0: none)", 100,
                 allow_minimum=True, integer=True)
    check_number("--max-restarts", args.max_restarts, "the restarts after a failed rank", 3,
                 allow_minimum=True, integer=True)
    check_number("--sample", args.sample, "the sample's length (0: none)", 200,
                 allow_minimum=True, integer=True)
    if args.microbatches is not None:
        check_number("--microbatches", args.microbatches, "the micro-batches per step", 4,
                     minimum=1, allow_minimum=True, integer=True)
    if args.peak_tflops is not None:
        check_number("--peak-tflops", args.peak_tflops, "a device's peak TFLOP/s", 312)
