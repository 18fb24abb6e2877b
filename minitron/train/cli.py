"""python -m minitron.train: train the GPT on a text, on any grid, with checkpoints and plots.

    python -m minitron.train                              # the shipped corpus, 1 process, ~2 min
    python -m minitron.train --tp 2 --sp --dp 2 --zero 1  # 4 CPU processes (minitron.launch)
    python -m minitron.train --pp 2 --microbatches 4 --resume runs/train/checkpoints/latest
    torchrun --nproc-per-node 8 -m minitron.train --tp 2 --pp 2 --dp 2   # the same, on GPUs

It shows a progress line (loss, tokens/s, MFU where the device's peak is known or given),
evaluates on held-out text (the corpus's last 10%), saves checkpoints (minitron.checkpoint:
loadable on any other grid), writes metrics.jsonl and loss.png to --out, and prints a sample
of generated text. A bad option, an impossible grid, a missing corpus or checkpoint, a
directory it cannot write: one line on stderr and exit code 2 (1 if a rank fails mid-run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from . import checkpoint, data
from ..estimate import flops
from ..grid import ParallelConfig
from ..runtime.launch import RankError, launch
from ..model.config import ModelConfig
from ..model.convert import gather_state_dict
from ..model.reference import GPT
from ..pipeline.partition import check_placement
from .engine import TrainingRun, check_supported, resolve_schedule


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):              # one line, not argparse's usage block
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m minitron.train", description=__doc__.split("\n")[0])
    a = p.add_argument
    for dim in ("tp", "pp", "dp", "virtual"):
        a(f"--{dim}", type=int, default=1)
    a("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    a("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    a("--schedule", default=None, help="pipeline schedule (1f1b, gpipe, interleaved, zb-h1, ...)")
    a("--microbatches", type=int, default=None, help="default: 2*pp with a pipeline, else 1")
    a("--steps", type=int, default=300)
    a("--batch", type=int, default=16, help="sequences per step (global)")
    a("--seq", type=int, default=64)
    a("--hidden", type=int, default=64)
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--lr", type=float, default=3e-3)
    a("--seed", type=int, default=0)
    a("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus.txt"))
    a("--out", default="runs/train")
    a("--eval-every", type=int, default=50)
    a("--save-every", type=int, default=100, help="0: no checkpoints")
    a("--resume", default=None, help="a checkpoint directory (any grid may have saved it)")
    a("--sample", type=int, default=200, help="characters of generated text at the end; 0: none")
    a("--peak-tflops", type=float, default=None, help="per-device peak for MFU (GPUs: detected)")
    return p


def configure(args) -> tuple[ModelConfig, ParallelConfig]:
    """Every check that can run before a rank starts; ValueError with the fix."""
    for name in ("steps", "batch", "seq", "eval_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    mcfg = ModelConfig(vocab_size=data.VOCAB_SIZE, seq_len=args.seq, hidden=args.hidden,
                       n_layers=args.layers, n_heads=args.heads)
    pcfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, virtual_pp=args.virtual,
                          sequence_parallel=args.sp)
    pcfg.validate(model=mcfg, seq_len=args.seq)
    if args.schedule and args.pp == 1 and args.virtual == 1:
        raise UsageError(f"--schedule {args.schedule} needs a pipeline: add --pp 2 (or more)")
    if args.pp > 1 or args.virtual > 1:
        check_placement(mcfg, args.pp, tuple(s % args.pp for s in range(args.pp * args.virtual)))
    args.microbatches = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    if args.batch % (args.dp * args.microbatches):
        raise UsageError(f"--batch {args.batch} must split into dp={args.dp} replicas of "
                         f"{args.microbatches} micro-batches: use a multiple of "
                         f"{args.dp * args.microbatches}")
    # an unknown or impossible schedule fails here, and what the engine does not run
    check_supported(pcfg, mcfg, torch.float32, args.zero,
                    resolve_schedule(pcfg, args.schedule, args.microbatches))
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"cannot write to --out {args.out}: {e.strerror}") from None
    if args.resume:
        checkpoint.check_compatible(checkpoint.read_manifest(args.resume), mcfg, args.resume)
    return mcfg, pcfg


# ---- what every rank runs -------------------------------------------------------------------
def worker(args, mcfg: ModelConfig, pcfg: ParallelConfig, progress_fd: int | None):
    run = TrainingRun(mcfg, pcfg, zero_stage=args.zero, microbatches=args.microbatches,
                      schedule=args.schedule, lr=args.lr, seed=args.seed)
    lead = run.grid.rank == 0
    tokens = np.memmap(os.path.join(args.out, "corpus.bin"), dtype=np.uint8, mode="r")  # main() made it
    train, val = data.split(tokens)
    loader = data.Loader(train, args.batch, args.seq, args.seed)
    held_out = data.Loader(val, args.batch, args.seq, args.seed + 1)
    start = 0
    if args.resume:
        start = checkpoint.load(args.resume, run.model, run.engine, run.optimizer)["step"]
    bar = _Progress(progress_fd if lead else None, args.steps)
    metrics, log = [], \
        open(os.path.join(args.out, "metrics.jsonl"), "a" if args.resume else "w") if lead else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (flops.detect_peak() or (None,))[0]
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss = run.step(*loader.batch(step), step)
        seconds = time.perf_counter() - t0
        rate = flops.throughput(mcfg, args.batch, seconds, gpus=pcfg.world_size, peak=peak, seq=args.seq)
        row = {"step": step + 1, "loss": loss, "tokens_per_s": rate["tokens/s"], "mfu": rate.get("MFU")}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row["eval_loss"] = run.evaluate(*held_out.batch(0))
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


class _Progress:
    """One line, rewritten in place on a terminal; a line every 10% otherwise."""

    def __init__(self, fd: int | None, total: int):
        self.out = os.fdopen(fd, "w") if fd is not None else None
        self.total, self.tty = total, self.out is not None and self.out.isatty()

    def show(self, row: dict) -> None:
        if self.out is None:
            return
        n = row["step"]
        filled = int(20 * n / self.total)
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a (--peak-tflops)"
        line = (f"step {n:>5}/{self.total} [{'#' * filled}{'.' * (20 - filled)}] loss {row['loss']:.3f}"
                f" | {row['tokens_per_s']:,.0f} tok/s | MFU {mfu}")
        if "eval_loss" in row:
            line += f" | eval {row['eval_loss']:.3f}"
        if self.tty:
            self.out.write("\r" + line + ("\n" if "eval_loss" in row else ""))
        elif "eval_loss" in row or n == 1:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.write("\n" if self.tty else "")
            self.out.close()


# ---- the parent -----------------------------------------------------------------------------
def plot(metrics: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train")
    ev = [m for m in metrics if "eval_loss" in m]
    ax.plot([m["step"] for m in ev], [m["eval_loss"] for m in ev], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="minitron.train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        mcfg, pcfg = configure(args)
        data.prepare(args.corpus, os.path.join(args.out, "corpus.bin"))
    except ValueError as e:
        print(f"minitron.train: error: {e}", file=sys.stderr)
        return 2
    try:
        results = launch(worker, args, mcfg, pcfg, os.dup(sys.stderr.fileno()), world_size=pcfg.world_size)
    except RankError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(lines) if "Error:" in ln), lines[-1] if lines else str(e))
        print(f"minitron.train: error: {lines[0] if lines else ''} {cause.strip()}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0
    metrics, sample = results[0]
    if metrics:
        plot(metrics, os.path.join(args.out, "loss.png"))
        print(f"loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}; metrics in "
              f"{args.out}/metrics.jsonl, curve in {args.out}/loss.png")
    if sample:
        print("sample:", sample)
    return 0
