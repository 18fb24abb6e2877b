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

import functools
import json
import os
import sys
import time

import numpy as np
import torch

from . import data, restart
from ..estimate import flops
from ..grid import ParallelConfig
from ..refusals import Refused
from ..runtime.launch import RankError
from ..runtime.process_group import end_of_run, under_torchrun
from ..config import ConfigError, ModelConfig
from ..model.convert import gather_state_dict
from ..model.reference import GPT
from .checkpoint_bias import biases_of_every_stage, load_biases
from .checkpoint_pieces import local_weights
from .engine import TrainingRun
from .flags import FLAGS, configure, parser
from .lr import describe, learning_rate
from .out_dir import claim_out, read_metrics
from .progress import Progress, plot


# ---- what every rank runs -------------------------------------------------------------------
def worker(args, mcfg: ModelConfig, pcfg: ParallelConfig, progress_fd: int | None):
    if args.resume or args.save_every:
        from . import checkpoint      # main() imported it before the ranks forked (see there)
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
    local = local_weights(run.model, run.engine)
    full = gather_state_dict({k: v.float() for k, v in local.items()}, mcfg, run.grid,
                             getattr(run.model, "placement", None))
    biases = biases_of_every_stage(run.model)      # not in the state dict (collective)
    if run.grid.rank != 0:
        return None
    gpt = GPT(mcfg).eval()
    gpt.load_state_dict(full)
    load_biases(gpt, biases, "the trained model")  # it routes as the run does
    ids = torch.tensor([data.encode("The ").tolist()])
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.sample):
            logits = gpt(ids[:, -mcfg.seq_len:])[:, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return data.escaped(ids[0].tolist())   # printed: no raw control byte reaches the terminal


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
        flagged = e.as_flags(FLAGS) if isinstance(e, (ConfigError, Refused)) else e
        print(f"minitron.train: error: {flagged}",
              file=sys.stderr)
        return 2
    if args.save_every or args.resume:
        # Here, before the ranks fork: they inherit it (train/checkpoint.py imports
        # torch.distributed.checkpoint, a second of CPU that each would pay on its own).
        # A run that saves and loads nothing does not import it at all.
        from . import checkpoint  # noqa: F401
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
