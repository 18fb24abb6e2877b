"""python -m minitron.train: train the GPT on a text, on any grid, with checkpoints and plots.

    python -m minitron.train                              # the shipped corpus, 1 process, ~2 min
    python -m minitron.train --tp 2 --sp --dp 2 --zero 1  # 4 CPU processes (minitron.launch)
    python -m minitron.train --pp 2 --microbatches 4 --resume runs/train/checkpoints/latest
    torchrun --nproc-per-node 8 -m minitron.train --tp 2 --pp 2 --dp 2   # the same, on GPUs

It shows a progress line (loss, tokens/s, MFU where the device's peak is known or given),
evaluates on held-out text (the corpus's last 10%), saves checkpoints (minitron.checkpoint:
loadable on any other grid), writes metrics.jsonl and loss.png to --out, and prints a sample
of generated text. A bad option, an impossible grid, a missing or too short corpus, a bad
checkpoint, a directory it cannot write or that already holds a run (continue it with
--resume, replace it with --overwrite): one line on stderr and exit code 2. A rank that
fails mid-run, or a loss that turns NaN or infinite (the run stops before that step's update,
and saves nothing more): exit code 1. A resumed run's metrics.jsonl keeps the rows up to its
checkpoint's step, then continues.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from . import checkpoint, data, flops
from .grid import ParallelConfig
from .launch import RankError, end_of_run, launch, under_torchrun
from .model.config import ModelConfig, check_number
from .model.convert import gather_state_dict
from .model.reference import GPT
from .pipeline.partition import check_placement
from .pipeline.schedules import make_schedule
from .training import TrainingRun, check_supported


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
    a("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "data", "corpus.txt"))
    a("--out", default="runs/train")
    a("--eval-every", type=int, default=50)
    a("--save-every", type=int, default=100, help="0: no checkpoints")
    a("--resume", default=None, help="a checkpoint directory (any grid may have saved it)")
    a("--overwrite", action="store_true", help="replace the run already in --out (its metrics, "
      "plot and checkpoints)")
    a("--sample", type=int, default=200, help="characters of generated text at the end; 0: none")
    a("--peak-tflops", type=float, default=None, help="per-device peak for MFU (GPUs: detected)")
    return p


def configure(args) -> tuple[ModelConfig, ParallelConfig]:
    """Every check that can run before a rank starts; ValueError with the fix."""
    check_flags(args)
    mcfg = ModelConfig(vocab_size=data.VOCAB_SIZE, seq_len=args.seq, hidden=args.hidden,
                       n_layers=args.layers, n_heads=args.heads)
    pcfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, virtual_pp=args.virtual,
                          sequence_parallel=args.sp)
    pcfg.validate(model=mcfg, seq_len=args.seq)
    check_supported(pcfg, mcfg, args.zero)
    if args.schedule and args.pp == 1 and args.virtual == 1:
        raise UsageError(f"--schedule {args.schedule} needs a pipeline: add --pp 2 (or more)")
    if args.pp > 1 or args.virtual > 1:
        check_placement(mcfg, args.pp, tuple(s % args.pp for s in range(args.pp * args.virtual)))
    if args.microbatches is None:
        args.microbatches = 2 * args.pp if args.pp > 1 else 1
    if args.batch % (args.dp * args.microbatches):
        raise UsageError(f"--batch {args.batch} must split into dp={args.dp} replicas of "
                         f"{args.microbatches} micro-batches: use a multiple of "
                         f"{args.dp * args.microbatches}")
    if args.pp > 1 or args.virtual > 1:        # an unknown or impossible schedule fails here
        make_schedule(args.schedule or ("interleaved" if args.virtual > 1 else "1f1b"),
                      args.pp, args.microbatches, args.virtual)
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
    if args.overwrite and args.resume:
        raise UsageError("--overwrite with --resume: --resume continues the run in --out, "
                         "--overwrite starts a new one there; pass one of them")
    check_number("--save-every", args.save_every, "the checkpoint interval (0: none)", 100,
                 allow_minimum=True, integer=True)
    check_number("--sample", args.sample, "the sample's length (0: none)", 200,
                 allow_minimum=True, integer=True)
    if args.microbatches is not None:
        check_number("--microbatches", args.microbatches, "the micro-batches per step", 4,
                     minimum=1, allow_minimum=True, integer=True)
    if args.peak_tflops is not None:
        check_number("--peak-tflops", args.peak_tflops, "a device's peak TFLOP/s", 312)


def check_writable(out: str) -> None:
    """Create --out and write a file into it. The probe has a name of its own: torchrun's
    processes all probe at once, and one's remove must not take away another's file."""
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror}") from None


RUN_FILES = ("metrics.jsonl", "loss.png", "checkpoints")


def existing_run(out: str) -> list[str]:
    """What an earlier run left in `out` (an empty checkpoints folder does not count)."""
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if "checkpoints" in found and not os.listdir(os.path.join(out, "checkpoints")):
        found.remove("checkpoints")
    return found


def check_replacing(args) -> None:
    """A run never silently replaces another: --resume continues it, --overwrite replaces it."""
    found = existing_run(args.out)
    if found and not (args.resume or args.overwrite):
        latest = os.path.join(args.out, "checkpoints", "latest")
        cont = f"--resume {latest} to continue it, " if os.path.exists(latest) else ""
        raise UsageError(f"--out {args.out} already holds a run ({', '.join(found)}): pass "
                         f"{cont}--overwrite to replace it, or another --out")


def claim_out(args) -> None:
    """One process (rank 0) makes --out ready: --overwrite removes the old run, saying what;
    --resume drops the metrics rows past the checkpoint, so the curve is this run's."""
    metrics = os.path.join(args.out, "metrics.jsonl")
    if args.overwrite:
        found = existing_run(args.out)
        if found:
            print(f"minitron.train: --overwrite: removing {', '.join(found)} from {args.out}",
                  file=sys.stderr)
        for name in found:
            path = os.path.join(args.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    elif args.resume and os.path.exists(metrics):
        try:
            kept = [line for line in open(metrics) if line.strip()
                    and json.loads(line)["step"] <= args.resume_step]
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{metrics} is not a metrics file of minitron.train: move it "
                             "away, or pass another --out") from None
        tmp = f"{metrics}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, metrics)


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


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


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
        mcfg, pcfg = configure(args)
        data.prepare(args.corpus, os.path.join(args.out, "corpus.bin"), seq=args.seq)
        if os.environ.get("RANK", "0") == "0":
            claim_out(args)
    except ValueError as e:
        print(f"minitron.train: error: {e}", file=sys.stderr)
        return 2
    try:
        results = launch(worker, args, mcfg, pcfg, os.dup(sys.stderr.fileno()), world_size=pcfg.world_size)
    except RankError as e:
        print(f"minitron.train: error: {one_line(e)}", file=sys.stderr)
        return 1
    try:
        if os.environ.get("RANK", "0") == "0":
            metrics, sample = results[0]
            if metrics:
                plot(read_metrics(args.out), os.path.join(args.out, "loss.png"))
                print(f"loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}; metrics in "
                      f"{args.out}/metrics.jsonl, curve in {args.out}/loss.png")
            if sample:
                print("sample:", sample)
    finally:
        end_of_run()        # under torchrun: every process waits here until rank 0 has written
    return 0


if __name__ == "__main__":
    code = main()
    if under_torchrun():    # leave without the interpreter's teardown (launch.end_of_run)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
