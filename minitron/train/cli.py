"""python -m minitron.train: train the GPT on a text, on any grid, with checkpoints and plots.

    python -m minitron.train                              # the shipped corpus, 1 process, ~2 min
    python -m minitron.train --tp 2 --sp --dp 2 --zero 1  # 4 CPU processes (minitron.launch)
    python -m minitron.train --pp 2 --microbatches 4 --resume runs/train/checkpoints/latest
    python -m minitron.train --dp 2 --save-every 20 --max-restarts 3   # survives a dead rank
    torchrun --nproc-per-node 8 -m minitron.train --tp 2 --pp 2 --dp 2   # the same, on GPUs

It shows a progress line (loss, tokens/s, MFU where the device's peak is known or given),
evaluates on held-out text (the corpus's last 10%), saves checkpoints (minitron.checkpoint:
loadable on any other grid), writes metrics.jsonl and loss.png to --out, and prints a sample
of generated text. A bad option, an impossible grid, a missing or too short corpus, a bad
checkpoint, a directory it cannot write or that already holds a run (continue it with
--resume, replace it with --overwrite: train/out_dir.py): one line on stderr and exit code 2. A
rank that fails mid-run, or a loss that turns NaN or infinite (the run stops before that step's
update, and saves nothing more): exit code 1; with --max-restarts N a failed rank instead
restarts every rank from the last checkpoint, up to N times (train/restart.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np
import torch

from . import checkpoint, data, restart
from ..estimate import flops
from ..grid import CP_VARIANTS, ParallelConfig
from ..runtime.launch import RankError
from ..runtime.process_group import end_of_run, under_torchrun
from ..model.config import CHOICES, ConfigError, ModelConfig, check_number
from ..model.fused import enable_kernels
from ..model.convert import gather_state_dict
from ..model.reference import GPT
from ..pipeline.partition import check_placement
from ..tensor_parallel.fp8 import RECIPES
from .engine import TrainingRun, check_supported, resolve_schedule
from .precision import PRECISIONS, resolve_precision
from .lr import LR_SCHEDULES, describe, learning_rate
from .out_dir import UsageError, check_replacing, check_writable, claim_out, read_metrics
from .progress import Progress, plot


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # one line, not argparse's usage block
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m minitron.train", description=__doc__.split("\n")[0])
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
           "tensor's own amax (current)")
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
         "capacity_factor": "--capacity-factor", "lr": "--lr", "eps": "--eps", "dtype": "--dtype"}

_MODEL_FLAGS = {"kv_heads": "n_kv_heads", "norm": "norm", "activation": "activation",
                "position": "position", "dropout": "dropout", "recompute": "recompute"}


def model_config(args) -> ModelConfig:
    """The ModelConfig the flags ask for; a flag left out keeps ModelConfig's default."""
    given = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items()
             if getattr(args, flag) is not None}
    return ModelConfig(vocab_size=data.VOCAB_SIZE, seq_len=args.seq, hidden=args.hidden,
                       n_layers=args.layers, n_heads=args.heads, tie_embeddings=args.tie,
                       use_kernels=args.kernels, n_experts=args.experts, topk=args.topk,
                       capacity_factor=args.capacity_factor, **given)


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
    pcfg.validate(model=mcfg, seq_len=args.seq)
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
        args.dtype_, args.fp8 = resolve_precision(args.dtype, args.fp8_recipe)
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
        manifest = checkpoint.read_manifest(args.resume)
        checkpoint.check_compatible(manifest, mcfg, args.resume)
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


# ---- what every rank runs -------------------------------------------------------------------
def worker(args, mcfg: ModelConfig, pcfg: ParallelConfig, progress_fd: int | None):
    run = TrainingRun(mcfg, pcfg, zero_stage=args.zero, microbatches=args.microbatches,
                      schedule=args.schedule, lr=args.lr, weight_decay=args.weight_decay,
                      max_norm=args.clip or None, dtype=args.dtype_, seed=args.seed, fp8=args.fp8)
    lr_at = functools.partial(learning_rate, peak=args.lr, steps=args.steps, warmup=args.warmup,
                              min_lr=args.min_lr, schedule=args.lr_schedule)
    lead = run.grid.rank == 0
    tokens = np.memmap(os.path.join(args.out, "corpus.bin"), dtype=np.uint8, mode="r")  # main() made it
    train, val = data.split(tokens)
    loader = data.Loader(train, args.batch, args.seq, args.seed)
    held_out = data.Loader(val, args.batch, args.seq, args.seed + 1)
    start = 0
    if args.resume:
        start = checkpoint.load(args.resume, run.model, run.engine, run.optimizer)["step"]
    bar = Progress(progress_fd if lead else None, args.steps)
    bar.header(describe(peak=args.lr, steps=args.steps, warmup=args.warmup, min_lr=args.min_lr,
                        schedule=args.lr_schedule))
    metrics, log = [], \
        open(os.path.join(args.out, "metrics.jsonl"), "a" if args.resume else "w") if lead else None
    on_gpu = run.grid.device.type == "cuda"     # gloo ranks on a GPU machine compute on CPUs
    peak = args.peak_tflops * 1e12 if args.peak_tflops else \
        ((flops.detect_peak() if on_gpu else None) or (None,))[0]
    for step in range(start, args.steps):
        restart.die_if_planted(step, run.grid.rank, args.attempt)
        t0 = time.perf_counter()
        run.set_lr(lr_at(step))
        loss = run.step(*loader.batch(step), step)
        seconds = time.perf_counter() - t0
        rate = flops.throughput(mcfg, args.batch, seconds, gpus=pcfg.world_size, peak=peak, seq=args.seq)
        row = {"step": step + 1, "loss": loss, "lr": lr_at(step), "tokens_per_s": rate["tokens/s"],
               "mfu": rate.get("MFU"), **run.health()}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row["eval_loss"] = run.evaluate(*held_out.batch(0))
            if not np.isfinite(row["eval_loss"]):       # every rank has the same value
                raise FloatingPointError(f"step {step + 1}: the held-out loss is "
                                         f"{row['eval_loss']}: the run diverged; lower --lr")
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            path = os.path.join(args.out, "checkpoints", f"step_{step + 1:06d}")
            checkpoint.save(path, run.model, run.engine, run.optimizer, step=step + 1,
                            extra={"data_step": step + 1, "seed": args.seed})
            if lead:
                _point_latest(os.path.join(args.out, "checkpoints"), path)
        if lead:
            metrics.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.show(row)
    bar.close()
    if log is not None:
        log.close()
    sample = _sample(run, mcfg, args) if args.sample else None
    return (metrics, sample) if lead else None


def _point_latest(folder: str, path: str) -> None:
    """checkpoints/latest -> the newest checkpoint, replaced atomically."""
    tmp = os.path.join(folder, f".latest.{os.getpid()}")
    os.symlink(os.path.basename(path), tmp)
    os.replace(tmp, os.path.join(folder, "latest"))


def _sample(run: TrainingRun, mcfg: ModelConfig, args) -> str | None:
    """Gather the weights into a single-device GPT on rank 0 and let it write (collective)."""
    local = checkpoint.local_weights(run.model, run.engine)
    full = gather_state_dict({k: v.float() for k, v in local.items()}, mcfg, run.grid,
                             getattr(run.model, "placement", None))
    if run.grid.rank != 0:
        return None
    gpt = GPT(mcfg).eval()
    gpt.load_state_dict(full)
    ids = torch.tensor([data.encode("The ").tolist()])
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.sample):
            logits = gpt(ids[:, -mcfg.seq_len:])[:, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return data.decode(ids[0].tolist())


def one_line(e: RankError) -> str:
    """The failed rank's first line and its exception, once (a death is one line already)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return str(e)
    cause = next((ln for ln in reversed(lines) if "Error:" in ln), lines[-1])
    return lines[0] if cause == lines[0] else f"{lines[0]} {cause}"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if under_torchrun():
            restart.continue_under_torchrun(args)
        mcfg, pcfg = configure(args)
        restart.start_of(args)
        data.prepare(args.corpus, os.path.join(args.out, "corpus.bin"), seq=args.seq)
        if os.environ.get("RANK", "0") == "0":
            claim_out(args)
    except ValueError as e:
        print(f"minitron.train: error: {e.as_flags(FLAGS) if isinstance(e, ConfigError) else e}",
              file=sys.stderr)
        return 2
    try:
        results = restart.launch_surviving(worker, args, mcfg, pcfg, describe=one_line)
    except RankError as e:
        print(f"minitron.train: error: {one_line(e)}", file=sys.stderr)
        return 1
    try:
        if os.environ.get("RANK", "0") == "0":
            metrics, sample = results[0]
            if metrics:
                curve = read_metrics(args.out)      # the whole run's, restarts included
                plot(curve, os.path.join(args.out, "loss.png"))
                print(f"loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}; metrics in "
                      f"{args.out}/metrics.jsonl, curve in {args.out}/loss.png")
            if sample:
                print("sample:", sample)
    finally:
        end_of_run()        # under torchrun: every process waits here until rank 0 has written
    return 0
