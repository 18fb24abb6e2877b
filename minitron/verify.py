"""python -m minitron.verify --tp 2 --sp [--pp 2 --schedule zb-h1]: the split model against one device.

Both models start from the same weights and the same dropout seed and see the same batches.
Every step compares, on rank 0 after gathering the shards (for the comparison only): logits,
loss, dL/dX (X = the input of the first block) and every weight gradient, each against the
float32 rounding bar of minitron.verify_checks (C * sqrt(K) * eps32 for sums of K terms).
Then both sides take one AdamW step on the same gradients, the reference's (each rank steps
its shards: AdamW is elementwise), and every tensor's update w_new - w_old is compared with
the reference's at the update's own scale. On every rank, the tensors a group holds whole
(norm weights, row-parallel biases, positions under tp) must be bitwise identical across it,
gradients and weights: the `replicas` rows, which name the tensor and ranks that differ.

Prints one row per (step, quantity) with the worst relative error and its tolerance, the
smallest margin (tolerance / error), then `PASS max_rel_err=...` (exit 0) or `FAIL ...`
(exit 1). Gradients and updates are grouped by name with the layer index replaced by `*`
(worst over the layers), covering every parameter.

AdamW's eps defaults to 1e-6 here, not torch's 1e-8: a gradient entry at the float32 noise
level (~1e-7 of its tensor's largest) counts as noise, not as a direction worth lr. (The check
no longer depends on it: both sides step on the same gradients, so `--eps 1e-8` passes too.)

`--pp`, `--virtual`, `--schedule` and `--microbatches` cut the model into pipeline stages
(pipeline/partition.py) and run every step with the pipeline executor and the named schedule
(pipeline/schedules.py): the same rows are compared, with the logits of every micro-batch and
dL/dX collected from the stages that made them, every gradient and weight gathered across the
stages, and the tied embedding's two copies (first and last stage) bitwise equal over the
`embedding` group. The batch defaults to one sequence per micro-batch.

`--recompute full|selective` makes the split model recompute every layer, or only its
attention core, in backward (ModelConfig.recompute); the reference keeps everything.

`--kernels` builds the split model with ModelConfig(use_kernels=True), so its norms, attention,
MLP activations and loss run minitron.kernels' fused Triton kernels, and steps it with
FusedAdamW; the reference keeps plain torch ops and torch.optim.AdamW, and the tolerances stay
the same. Where the ranks run on the CPU (no GPU for each of them) it sets TRITON_INTERPRET=1
before anything imports triton, so the kernels run in Triton's interpreter (slowly), and says
so in the header.

`--dp N` runs N data-parallel replicas (composing with --tp/--sp and --pp): each takes its own
rows of the global batch (dropout masks are keyed by global row) and the engine of
minitron.data_parallel averages the gradients, in buckets started from backward hooks; with
`--zero 1|2|3` the gradients are reduce-scattered and ZeRO's ZeroOptimizer steps fp32 master
weights of each rank's shard (stage 3 also shards the weights, gathered per layer, inside
pipeline stages too: each pipeline rank shards its own stages). The logits
and dL/dX are gathered back over dp, the loss averaged over dp: the rows are the whole batch's,
compared with the reference on the whole batch. The gradients compared are the reduced ones,
rebuilt from the shards (data_parallel.checks); replicas must stay bitwise equal over dp, the
gradients under plain DP, the weights below stage 3. verify_steps.py has the per-rank steps.

`--dtype bfloat16|float16` runs both sides in that dtype with fp32 master weights (the split
side through the data-parallel engine at any dp, the reference with precision.MasterWeightsAdamW);
float16 scales the loss by a fixed 1024 on both sides. Both sides round every op to 16 bits in
different places, so logits, loss, dL/dX and gradients are held to precision.tolerance16:
C16 * eps16 = 8 * eps16 relative to the tensor's largest entry (bf16 6.2e-2, fp16 7.8e-3;
measured at most about 3 eps16). Updates keep the float32 update bar beyond 2 spacings of the
stored 16-bit weight: both sides step fp32 masters on the same gradients.

`--experts N` makes the MLP of layers 0, k, 2k, ... (`--moe-every k`) a mixture of N experts
(minitron/moe/: `--topk`, `--capacity-factor`, `--pre-softmax`, aux and z-loss coefficients),
and `--ep E` spreads each layer's experts over E ranks (tp defaults to 1 then; with --tp > 1
sequence parallelism is required). Expert-parallel ranks are data-parallel replicas of the
dense layers, so they run through the data-parallel engine on their own rows (dp x ep of
them): dense gradients averaged over dense_dp, expert gradients summed over dp_cp. The loss
includes the routers' auxiliary losses on both sides; a `moe drops` row per step checks that a
capacity factor dropped exactly the reference's (token, expert) pairs.

`--cp C` cuts every sequence of the batch into 2C chunks and gives cp rank r chunks r and
2C-1-r (zigzag: equal causal work, minitron/context_parallel); attention reaches the other
ranks' keys and values by `--cp-variant` (ring, allgather, ulysses). A rank's loss is the mean
over its tokens, so the loss is averaged over cp, logits and dL/dX are gathered back in token
order (dL/dX divided by C), and gradients are averaged over cp (finalize_grads; with --dp the
engine's average over dense_dp = dp x cp). With --pp every cp rank of a stage runs the schedule
on its chunks of each micro-batch, and stages exchange s/cp tokens. Not yet with --ep or 16-bit
dtypes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from .grid import CP_VARIANTS, ParallelConfig, validate_model
from .launch import DEFAULT_TIMEOUT, _pick_backend, launch
from .model.config import CHOICES, ModelConfig, check_number
from .model.fused import check_kernels
from .pipeline.schedules import SCHEDULES, make_schedule
from .verify_checks import Report, Row
from .verify_plants import Plant
from .verify_steps import (BUCKET_NUMEL, FP16_LOSS_SCALE, check_data_parallel, make_batch,
                           parallel_step, reference_step, run_rank, uses_engine)

__all__ = ["verify", "main", "run_rank", "make_batch", "parallel_step", "reference_step",
           "pipeline_schedule", "Report", "Row"]


# Dimensions with a ParallelConfig field but no implementation yet: option -> (what, issue).
UNBUILT: dict[str, tuple[str, str]] = {}


def check_built(pcfg: ParallelConfig) -> None:
    for field, (what, issue) in UNBUILT.items():
        if getattr(pcfg, field) > 1:
            raise NotImplementedError(f"{what} is not built yet (issue: {issue}); "
                                      f"set {field}=1")


def enable_kernels(mcfg: ModelConfig, world_size: int) -> str:
    """Make minitron.kernels runnable on the ranks launch() will start; say how they run.

    Ranks on GPUs run the compiled kernels. Ranks on the CPU need Triton's interpreter, which
    triton.jit picks when triton is first imported: so TRITON_INTERPRET=1 goes into this
    process's environment here, before anything imports triton, and the forked ranks inherit
    it. Raises ValueError (before any rank starts) where the kernels still cannot run.
    """
    if _pick_backend(world_size) == "nccl":
        check_kernels(mcfg, torch.device("cuda"))
        return "kernels=compiled Triton on the GPUs"
    os.environ["TRITON_INTERPRET"] = "1"
    check_kernels(mcfg, torch.device("cpu"))   # e.g. triton already imported without it
    return ("kernels=Triton interpreter on the CPU (TRITON_INTERPRET=1 set by minitron.verify: "
            "no GPU per rank)")


def pipeline_schedule(pcfg: ParallelConfig, name: str | None = None,
                      microbatches: int | None = None):
    """The pipeline Schedule verify runs, or None for the plain step (pp = virtual = 1, no name).

    Defaults: 1F1B (interleaved with virtual > 1), 2*pp micro-batches; ZB-V always has two
    chunks per rank."""
    if name is None and pcfg.pp == 1 and pcfg.virtual_pp == 1:
        return None
    name = name or ("interleaved" if pcfg.virtual_pp > 1 else "1f1b")
    virtual = 2 if name == "zb-v" and pcfg.virtual_pp == 1 else pcfg.virtual_pp
    return make_schedule(name, pcfg.pp, microbatches or 2 * pcfg.pp, virtual)


def verify(parallel_config: ParallelConfig, model_config: ModelConfig, steps: int = 3, *,
           dtype: torch.dtype = torch.float32, seed: int = 0, lr: float = 1e-4, eps: float = 1e-6,
           batch: int | None = None, seq: int | None = None, timeout: float = DEFAULT_TIMEOUT,
           plant: str | None = None, schedule: str | None = None,
           microbatches: int | None = None, zero: int | None = None) -> Report:
    """Launch parallel_config.world_size ranks, compare for `steps` AdamW steps, return the report.

    With pp > 1, virtual_pp > 1 or a `schedule` name (pipeline.schedules.SCHEDULES) the model
    is cut into pipeline stages and run by the pipeline executor (see pipeline_schedule);
    `batch` defaults to one sample per micro-batch (2 without a pipeline), per dp replica.
    `zero` (0-3; dp > 1 and 16-bit dtypes too) steps through a data-parallel engine.
    With model_config.use_kernels this process's environment may get TRITON_INTERPRET=1
    (see enable_kernels).
    """
    check_built(parallel_config)
    sched = pipeline_schedule(parallel_config, schedule, microbatches)
    if sched is not None:     # ZB-V has two chunks per rank whatever virtual_pp says
        parallel_config = dataclasses.replace(parallel_config, virtual_pp=sched.virtual)
    batch = split_batch(batch, parallel_config, sched, "a batch of")
    check_data_parallel(parallel_config, model_config, dtype, zero, sched)
    if steps < 1 or batch < 1:
        raise ValueError(f"verify needs steps >= 1 and batch >= 1, got steps={steps}, batch={batch}")
    seq = seq or model_config.seq_len
    validate_model(parallel_config, model_config, seq)
    Plant(plant)                                      # an unknown plant fails here, not in a rank
    if model_config.dropout_rng == "per_rank" and model_config.dropout > 0:
        raise ValueError("dropout_rng='per_rank' draws masks no single device draws, so nothing can be "
                         "compared: verify with dropout_rng='exact' (the default) or dropout=0")
    if model_config.use_kernels:
        check_kernels_dtype(dtype)
        enable_kernels(model_config, parallel_config.world_size)
    rows = launch(run_rank, parallel_config, model_config, steps, dtype, seed, lr, eps, batch, seq,
                  plant, sched, zero, world_size=parallel_config.world_size, timeout=timeout)[0]
    return Report(rows)


def split_batch(batch: int | None, pcfg: ParallelConfig, sched, what: str) -> int:
    """The batch (default: one sequence per micro-batch, else 2, per dp replica; with ep, one
    row per dp x ep replica at least), checked to cut into the replicas' whole micro-batches."""
    per_replica = sched.microbatches if sched is not None else 1
    replicas = pcfg.dp * pcfg.ep          # expert-parallel ranks run their own rows too
    batch = batch or (per_replica * replicas if sched is not None else max(2 * pcfg.dp, replicas))
    if batch % (per_replica * replicas) == 0:
        return batch
    if replicas == 1:
        raise ValueError(f"{what} {batch} cannot be cut into {per_replica} equal "
                         f"micro-batches: use a multiple of {per_replica}")
    who = f"dp={pcfg.dp}" if pcfg.ep == 1 else f"dp x ep={replicas}"
    raise ValueError(f"{what} {batch} cannot be cut into {who} replicas of {per_replica} "
                     f"micro-batch(es): use a multiple of {replicas * per_replica}")


def check_kernels_dtype(dtype: torch.dtype) -> None:
    if dtype != torch.float32:
        raise ValueError(f"--kernels: the kernels compute in float32 (and 16-bit on a GPU), "
                         f"so comparing them in {dtype} checks nothing more: use --dtype float32")


EXAMPLES = """examples:
  python -m minitron.verify --tp 2 --sp
  python -m minitron.verify --tp 2 --sp --norm rmsnorm --activation swiglu --position rope --kv-heads 2
  python -m minitron.verify --tp 2 --sp --kernels      fused Triton kernels and FusedAdamW
  python -m minitron.verify --tp 1 --cp 2              ring attention over 2 ranks (zigzag chunks)
  python -m minitron.verify --tp 2 --sp --cp 2 --cp-variant ulysses
  python -m minitron.verify --tp 1 --cp 2 --dp 2 --zero 1   context and data parallelism with ZeRO-1
  python -m minitron.verify --tp 1 --cp 2 --pp 2 --schedule zb-h1 --microbatches 4   cp inside stages
  python -m minitron.verify --tp 1 --pp 2 --schedule zb-h1 --microbatches 4
  python -m minitron.verify --tp 2 --sp --pp 2 --schedule 1f1b --microbatches 4
  python -m minitron.verify --tp 1 --pp 4 --virtual 2 --schedule interleaved --microbatches 8 --layers 8
  python -m minitron.verify --tp 1 --dp 2               data parallel: each replica its rows
  python -m minitron.verify --tp 2 --sp --dp 2 --zero 1 Megatron's distributed optimizer
  python -m minitron.verify --tp 1 --dp 4 --zero 3      parameters sharded too
  python -m minitron.verify --tp 1 --dp 2 --pp 2 --zero 3 --schedule zb-h1 --microbatches 4   ZeRO-3 in stages
  python -m minitron.verify --tp 2 --dtype bfloat16     16-bit, fp32 master weights
  python -m minitron.verify --ep 2 --experts 4 --topk 2  experts on 2 ranks (tp defaults to 1)
  python -m minitron.verify --ep 2 --tp 2 --sp --experts 4
  python -m minitron.verify --ep 4 --experts 8 --capacity-factor 1.0
  python -m minitron.verify --ep 2 --dp 2 --experts 4

exit status: 0 PASS, 1 FAIL, 2 bad options"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the examples kept line by line."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minitron.verify", description=__doc__.split("\n")[0],
                                epilog=EXAMPLES, formatter_class=_HelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default 2; 1 with --ep > 1)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages' ranks)")
    g.add_argument("--virtual", type=int, default=1, dest="virtual_pp",
                   help="model chunks (stages) per pipeline rank: interleaved schedules")
    g.add_argument("--schedule", choices=sorted(SCHEDULES), default=None,
                   help="pipeline schedule (default with --pp > 1: 1f1b, interleaved with --virtual > 1; "
                        "zb-v always has 2 chunks per rank)")
    g.add_argument("--microbatches", type=_positive, default=None,
                   help="micro-batches per step of a pipeline schedule (default 2 * pp)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size: every sequence split "
                   "over cp ranks (2*cp zigzag chunks)")
    g.add_argument("--cp-variant", choices=CP_VARIANTS, default="ring",
                   help="how attention reaches the other cp ranks' keys and values")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size: replicas, each on its "
                   "own rows of the batch")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage of the data-parallel engine (default: 0 where one runs)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size: the experts of each "
                   "MoE layer spread over ep ranks (needs --experts; a replica of the dense layers)")
    r = p.add_argument_group("run")
    r.add_argument("--steps", type=_positive, default=3)
    r.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                   default="float32", help="16-bit: fp32 master weights (see the module docstring)")
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
                   help="activation recomputation in the split model (minitron/recompute.py): "
                        "every layer (full) or the attention core (selective)")
    r.add_argument("--plant", default=None, help=argparse.SUPPRESS)   # tests: verify_plants.PLANTS
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=2)
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
    e.add_argument("--aux-loss", type=float, default=0.01, help="Switch load-balancing coefficient")
    e.add_argument("--z-loss", type=float, default=1e-3, help="router z-loss coefficient")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_number("--lr", args.lr, "the learning rate", "1e-4")
        check_number("--eps", args.eps, "AdamW's eps", "1e-6")
        if args.capacity_factor is not None:
            check_number("--capacity-factor", args.capacity_factor, "the capacity factor", 1.0)
        tp = args.tp if args.tp is not None else (1 if args.ep > 1 else 2)
        pcfg = ParallelConfig(tp=tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep,
                              virtual_pp=args.virtual_pp, sequence_parallel=args.sp,
                              cp_variant=args.cp_variant)
        check_built(pcfg)
        sched = pipeline_schedule(pcfg, args.schedule, args.microbatches)
        if sched is not None:
            pcfg = dataclasses.replace(pcfg, virtual_pp=sched.virtual)
        batch = split_batch(args.batch, pcfg, sched, "--batch")
        mcfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                           n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                           norm=args.norm, activation=args.activation, position=args.position,
                           dropout=args.dropout, tie_embeddings=args.tie, bias=not args.no_bias,
                           use_kernels=args.kernels, recompute=args.recompute,
                           n_experts=args.experts, topk=args.topk, moe_every=args.moe_every,
                           capacity_factor=args.capacity_factor, router_pre_softmax=args.pre_softmax,
                           aux_loss_coeff=args.aux_loss, z_loss_coeff=args.z_loss)
        validate_model(pcfg, mcfg)
        Plant(args.plant)
        dtype = getattr(torch, args.dtype)
        check_data_parallel(pcfg, mcfg, dtype, args.zero, sched)
        kernels = "kernels=off (plain torch ops)"
        if args.kernels:
            check_kernels_dtype(dtype)
            kernels = enable_kernels(mcfg, pcfg.world_size)   # before anything imports triton
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pipeline = "" if sched is None else (f"\nschedule={sched.name} microbatches={sched.microbatches} "
                                         f"virtual={sched.virtual} stage_rank={sched.stage_rank}")
    if uses_engine(pcfg, args.zero, dtype):
        scale = f" loss_scale={FP16_LOSS_SCALE:g}" if dtype == torch.float16 else ""
        pipeline += f"\ndata parallel: zero={args.zero or 0} bucket_numel={BUCKET_NUMEL}{scale}"
    print(f"{pcfg}\n{mcfg}\nbatch={batch} steps={args.steps} dtype={args.dtype} seed={args.seed} "
          f"lr={args.lr} eps={args.eps}\n{kernels}{pipeline}")
    report = verify(pcfg, mcfg, args.steps, dtype=dtype, seed=args.seed, lr=args.lr, eps=args.eps,
                    batch=batch, plant=args.plant, schedule=args.schedule,
                    microbatches=args.microbatches, zero=args.zero)
    print(report.table())
    print(report.verdict())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
